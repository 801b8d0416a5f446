"""The placement policies by name (`placement.policy` in the controller's config).

`demand` (controller/placement.py) follows demand with copies and weighs the cost of reloading;
`lru` (controller/placement_lru.py) is the baseline the placement benchmark compares it with. Both
implement `PlacementPolicy`, so the reconcile loop and the benchmark call either the same way.
"""

from __future__ import annotations

from controller.placement import PlacementPolicy, plan_region
from controller.placement_lru import plan_region_lru

POLICIES: dict[str, PlacementPolicy] = {"demand": plan_region, "lru": plan_region_lru}
