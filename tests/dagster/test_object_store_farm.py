"""A farm whose store is ``s3://BUCKET/PREFIX``: its records need a database URL (the
RenderFarm component and the resource refuse it without one, naming it), and the
location is kept as given, never taken for a folder under the project."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import dagster as dg
import pytest

from comfy_assets.farm.component import RenderFarm, RenderFarmServer
from comfy_assets.farm.resources import ResultStoreResource
from comfy_assets.store import NoDatabase, NoLocalFolder

S3 = "s3://farm-bucket/draft"


def test_a_farm_storing_in_s3_without_a_database_url_fails_to_load_naming_it(
    tmp_path: Path,
) -> None:
    farm = RenderFarm(
        servers=[RenderFarmServer(name="gpu0", url="http://127.0.0.1:9")],
        job_dirs=["jobs"],
        store=S3,
        key_prefix=["draft"],
    )
    context = cast(dg.ComponentLoadContext, SimpleNamespace(project_root=tmp_path))
    with pytest.raises(ValueError, match=f"store: {S3} is an object store: give db_url"):
        farm.build_defs(context)


def test_the_resource_keeps_the_s3_location_and_needs_a_database_url() -> None:
    resource = ResultStoreResource(folder=S3)
    with pytest.raises(NoDatabase, match=f"--store {S3}: an object store keeps files"):
        resource.open()
    with pytest.raises(NoLocalFolder, match=f"the store {S3} has no folder on this machine"):
        _ = resource.root
