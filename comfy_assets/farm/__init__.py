"""What the Dagster layer's faces (``comfy_assets.assets``, ``resources``, ``sensors``,
``definitions``) share: one render farm's definitions, built from its names.

- ``names``: a farm's asset keys, partitions, sensor, job and resource names (``Farm``).
- ``defs``: the factory, a farm's settings in, its ``Definitions`` out.
- ``component``: the ``RenderFarm`` component (``dg``), a farm from YAML.
- ``assets``, ``job_file_sensor``, ``dead_runs``, ``resources``: what each definition does.
- ``partitions``, ``versions``, ``launched_partition``: job files as partitions, the
  version a run renders, the partition a launch names.
- ``metadata``, ``automation``: what the UI shows, and when Dagster builds again.

Nothing here imports the faces: they import from here.
"""
