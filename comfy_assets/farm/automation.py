"""When each asset of a farm is built again by its automation sensors (Dagster's
declarative automation): render_results after a render launched without it, all_results
after any results, a storyboard's film after a render that changed it."""

from __future__ import annotations

from dagster import AutomationCondition

# Built again after renders however it was launched (a backfill of renders alone, say),
# unless the same run builds it; all_results follows it.
RENDER_RESULTS_CONDITION = (
    AutomationCondition.any_deps_updated().since_last_handled()
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("renders updated")

# Built again after any partition's results change, once nothing of its own is running.
# Unlike AutomationCondition.eager() it does not wait for every partition to exist: a job
# file that was never rendered (or failed) would hold it back for ever. A change is
# answered only by a request made after it, not by an update of its own (as
# since_last_handled would have it): a run of it may read the tables before a partition's
# results change and end after them, and that change would be taken as handled, leaving
# all_results stale. The trigger is the deps' newly_updated itself, so the since compares
# its timestamps with the request's (and/or operators drop them).
ALL_RESULTS_CONDITION = (
    AutomationCondition.any_deps_match(AutomationCondition.newly_updated())
    .since(AutomationCondition.newly_requested())
    .with_label("results updated since requested")
    | AutomationCondition.newly_missing().since_last_handled().with_label("missing")
) & ~AutomationCondition.in_progress()

# Built once renders of the same key is, by films_automation_sensor: after the run that
# rendered the storyboard has ended, again after each render that changed its data version
# (a job done anew, a new take, a dead letter requeued and rendered); a render that
# changed nothing, as a backfill over every partition, cuts no film again.
FILMS_CONDITION = (
    (
        AutomationCondition.newly_missing()
        | AutomationCondition.any_deps_match(AutomationCondition.data_version_changed())
    ).since_last_handled()
    & ~AutomationCondition.any_deps_missing()
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("renders changed")
