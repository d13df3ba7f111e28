"""What the user pinned in an earlier plan (`hetero plan --from OLD_PLAN`): entries marked `pinned: true` survive
re-planning as written, checked against the profile first, each section its own (`Section.pinned`)."""

from __future__ import annotations

from hetero.plan.section import Pins
from hetero.plan.sections import TABLE
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile


def pins_of(profile: Profile, previous: Plan | None) -> Pins:
    if previous is None:
        return Pins(entries={})
    return Pins(entries={section.name: section.pinned(profile, previous) for section in TABLE})
