"""The fault campaign: seeded random schedules (schedule), played against fakes and
``comfy-assets run`` subprocesses (play), checked by invariants (invariants)."""
