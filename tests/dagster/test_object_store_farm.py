"""A farm whose store is ``s3://BUCKET/PREFIX``: its records need a database URL (the
RenderFarm component and the resource refuse it without one, naming it), and the
location is kept as given, never taken for a folder under the project."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster.components.testing import create_defs_folder_sandbox

from comfy_assets.farm.component import RenderFarm
from comfy_assets.farm.resources import ResultStoreResource
from comfy_assets.store import NoDatabase, NoLocalFolder

S3 = "s3://farm-bucket/draft"


def test_a_farm_storing_in_s3_without_a_database_url_fails_to_load_naming_it(
    tmp_path: Path,
) -> None:
    attributes = {
        "servers": [{"name": "gpu0", "url": "http://127.0.0.1:9"}],
        "job_dirs": [str(tmp_path / "jobs")],
        "store": S3,
        "key_prefix": ["draft"],
    }
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
    assert any(f"store: {S3} is an object store: give db_url" in text for text in chain), chain


def test_the_resource_keeps_the_s3_location_and_needs_a_database_url() -> None:
    resource = ResultStoreResource(folder=S3)
    with pytest.raises(NoDatabase, match=f"--store {S3}: an object store keeps files"):
        resource.open()
    with pytest.raises(NoLocalFolder, match=f"the store {S3} has no folder on this machine"):
        _ = resource.root
