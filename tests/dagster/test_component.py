"""The RenderFarm component: scaffolded by dg, configured by defs.yaml (secrets by
{{ env.VAR }}), two farms in one project with their own keys, sensors, checks, jobs and
stores, each rendering its own job files on its own servers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml
from dagster import AssetCheckKey, AssetKey, DagsterInstance, EnvVar, instance_for_test
from dagster.components.testing import create_defs_folder_sandbox

from comfy_assets.farm.component import RenderFarm
from comfy_assets.jobs.parse import load_job_file
from fake_comfy import FakeComfy
from tests.support import write_jobs

VENV = Path(sys.prefix)
FARMS = ("draft", "final")


def farm_attributes(name: str, root: Path) -> dict:
    """A farm whose server URL comes from the environment, as a secret would."""
    return {
        "servers": [{"name": "gpu0", "url": f"{{{{ env.{name.upper()}_GPU0_URL }}}}"}],
        "job_dirs": [str(root / "jobs" / name)],
        "store": str(root / "store" / name),
        "key_prefix": [name],
    }


def executed(fake: FakeComfy) -> set[str]:
    return {run["prompt_id"] for run in fake.stats["runs"] if run["outcome"] == "success"}


def test_the_scaffolder_writes_a_farm_named_after_its_folder() -> None:
    with create_defs_folder_sandbox() as sandbox:
        path = sandbox.scaffold_component(component_cls=RenderFarm, defs_path="draft")
        written = yaml.safe_load((path / "defs.yaml").read_text())
    # The sandbox names the class by its module; dg by the registry (the test below).
    assert written["type"] == "comfy_assets.farm.component.RenderFarm"
    assert written["attributes"]["key_prefix"] == ["draft"]
    assert written["attributes"]["job_dirs"] == ["jobs/draft"]
    assert written["attributes"]["store"] == "store/draft"


def test_two_farms_in_one_project_render_each_its_own_files_on_its_own_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = {name: FakeComfy(prompt_seconds=0.005) for name in FARMS}
    job_files = {
        name: write_jobs(tmp_path / "jobs" / name, 2, name="shots.jsonl", salt=name)
        for name in FARMS
    }
    with ExitStack() as stack, create_defs_folder_sandbox() as sandbox:
        # The draft farm's database URL is a secret of the environment too.
        monkeypatch.setenv("DRAFT_DB_URL", f"sqlite:///{tmp_path / 'draft.db'}")
        for name, fake in fakes.items():
            url = stack.enter_context(fake.serve_in_thread(port=0))
            monkeypatch.setenv(f"{name.upper()}_GPU0_URL", url)
            attributes = farm_attributes(name, tmp_path)
            if name == "draft":
                attributes["db_url"] = "{{ env.DRAFT_DB_URL }}"
            sandbox.scaffold_component(
                component_cls=RenderFarm,
                defs_path=name,
                defs_yaml_contents={"type": "comfy_assets.RenderFarm", "attributes": attributes},
            )
        with sandbox.build_all_defs() as defs, instance_for_test() as instance:
            keys = set(defs.resolve_all_asset_keys())
            for name in FARMS:
                for asset in ("job_files", "renders", "render_results", "all_results", "films"):
                    assert AssetKey([name, asset]) in keys
                graph = defs.resolve_asset_graph()
                assert AssetCheckKey(AssetKey([name, "renders"]), "no_dead_letters") in (
                    graph.asset_check_keys
                )
                for sensor in ("job_file_sensor", "films_automation_sensor", "dead_runs_sensor"):
                    assert defs.resolve_sensor_def(f"{name}_{sensor}").name == f"{name}_{sensor}"
                instance.add_dynamic_partitions(f"{name}_job_files", ["shots"])
                job = defs.resolve_job_def(f"{name}_render_job")
                assert job.execute_in_process(partition_key="shots", instance=instance).success
            assert len(keys) == 2 * 5
            # The server URL, a secret, is read at run time: the UI shows its variable.
            comfy = defs.resources["draft_comfy"]
            for secret, name in (
                (comfy.servers[0].url, "DRAFT_GPU0_URL"),
                (defs.resources["draft_result_store"].db_url, "DRAFT_DB_URL"),
            ):
                assert isinstance(secret, EnvVar) and secret == name

    for name in FARMS:
        prompt_ids = {job.prompt_id for job in load_job_file(job_files[name]).jobs}
        assert executed(fakes[name]) == prompt_ids  # its own jobs, on its own server
        assert (tmp_path / "store" / name / "shots" / "results.csv").is_file()
        assert len(prompt_ids) == 2
    assert (tmp_path / "draft.db").is_file()  # the database the secret URL named
    assert not (tmp_path / "store" / "draft" / "store.db").exists()
    assert (tmp_path / "store" / "final" / "store.db").is_file()


def test_a_farm_with_a_server_url_that_is_not_one_fails_to_load_naming_it(
    tmp_path: Path,
) -> None:
    attributes = farm_attributes("draft", tmp_path)
    attributes["servers"] = [{"name": "gpu0", "url": "not a url"}]
    with create_defs_folder_sandbox() as sandbox:
        sandbox.scaffold_component(
            component_cls=RenderFarm,
            defs_path="draft",
            defs_yaml_contents={"type": "comfy_assets.RenderFarm", "attributes": attributes},
        )
        with pytest.raises(Exception) as raised:
            with sandbox.build_all_defs():
                pass
    chain = []
    error: BaseException | None = raised.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any(
        "servers: server 'gpu0=not a url': not an http(s)://host[:port] URL" in text
        for text in chain
    ), chain


def dg(project: Path, *args: str, home: Path, env: dict[str, str], stderr: bool = False) -> str:
    done = subprocess.run(
        [str(project / ".venv" / "bin" / "dg"), *args],
        cwd=project,
        env={**env, "DAGSTER_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + (done.stderr if stderr else "")


@pytest.mark.timeout(600)
def test_a_fresh_dg_project_scaffolds_two_farms_and_materializes_a_partition_of_each(
    tmp_path: Path,
) -> None:
    create = VENV / "bin" / "create-dagster"
    if not create.exists():
        pytest.skip("create-dagster is not installed (make installs it)")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("COMFY_ASSETS_") and key != "DAGSTER_HOME"
    }
    subprocess.run(
        [str(create), "project", "studio", "--no-uv-sync"],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    project = tmp_path / "studio"
    (project / ".venv").symlink_to(VENV)  # this environment, comfy-assets installed in it
    env["PYTHONPATH"] = str(project / "src")  # the new project's own package
    home = tmp_path / "home"
    home.mkdir()
    fakes = {name: FakeComfy(prompt_seconds=0.005) for name in FARMS}
    with ExitStack() as stack:
        for name, fake in fakes.items():
            env[f"{name.upper()}_GPU0_URL"] = stack.enter_context(fake.serve_in_thread(port=0))
            dg(project, "scaffold", "defs", "comfy_assets.RenderFarm", name, home=home, env=env)
            defs_yaml = project / "src" / "studio" / "defs" / name / "defs.yaml"
            scaffolded = yaml.safe_load(defs_yaml.read_text())
            assert scaffolded["attributes"]["key_prefix"] == [name]
            assert (project / "jobs" / name).is_dir()  # the job folder it names, made
            # The scaffolded folders are the project's; the server comes from the environment.
            scaffolded["attributes"]["servers"][0]["url"] = f"{{{{ env.{name.upper()}_GPU0_URL }}}}"
            defs_yaml.write_text(yaml.safe_dump(scaffolded))
            write_jobs(project / "jobs" / name, 2, name="shots.jsonl", salt=name)

        listed = dg(project, "list", "components", "--json", home=home, env=env)
        assert "comfy_assets.RenderFarm" in {item["key"] for item in json.loads(listed)["items"]}
        defs = dg(project, "list", "defs", "--json", home=home, env=env)
        for name in FARMS:
            assert f"{name}/renders" in defs and f"{name}_job_file_sensor" in defs
        # No sensor has ticked (no daemon): docs/dagster.md's launch adds the partition
        # from the watched folder (every farm of the project loads, each adds its own) and
        # brings results.csv along.
        said = ""
        for name in FARMS:
            said += dg(
                project,
                "launch",
                "--assets",
                f"{name}/renders,{name}/render_results",
                "--partition",
                "shots",
                home=home,
                env=env,
                stderr=True,
            )
        for name in FARMS:
            job_file = project / "jobs" / name / "shots.jsonl"
            assert said.count(f"added partition shots of {name}_job_files from {job_file}") == 1
        with DagsterInstance.from_config(str(home)) as instance:
            for name in FARMS:
                assert instance.get_dynamic_partitions(f"{name}_job_files") == ["shots"]

    for name in FARMS:
        job_file = load_job_file(project / "jobs" / name / "shots.jsonl")
        assert executed(fakes[name]) == {job.prompt_id for job in job_file.jobs}
        assert (project / "store" / name / "shots" / "results.csv").is_file()
    shutil.rmtree(project / "store")
