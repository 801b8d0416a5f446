"""`skewserve plan`: from measured capacity, traffic and prices to servers and cost over the day.

Inputs (typed, validated at the edge; each error names the file and field):
- capacity: requests/s one Triton server sustains within a p99 latency SLO, per instance type:
  a capacity file (measurements of rps and p99 per instance type; the best rps within the SLO is
  kept) or a `skewserve loadtest` output directory (its aggregated rps and p99, divided by the
  number of servers the test ran against);
- traffic (YAML): per region a peak in requests/s and a 24-value daily curve, fraction of the peak
  per hour in UTC, so regions in other time zones peak at other hours (default: a business-day curve);
- prices (YAML): per instance type on-demand, reserved (effective hourly) and spot $/hour, with
  optional per-region overrides.

The model (each step is one small function below, tested against hand-computed cases):
    backend rps(h)   = peak * curve[h] * (1 - cache hit rate) * escalation rate
                       (hits never reach Triton; an edge tier answers the rest but the escalated)
    servers(h)       = max(min_servers, ceil(backend rps(h) / (capacity * utilisation)))
    baseline         = min over the day of servers(h)  -> reserved instances, always on
    elastic(h)       = servers(h) - baseline           -> spot_share on spot, the rest on-demand
    cost(h)          = baseline * reserved + elastic(h) * (spot_share * spot + (1 - spot_share) * on_demand)
    month            = 730 h (the day repeated 730/24 times)
    autoscaler       = min: baseline, max: peak servers + spare_servers
The instance type of a region is the one with the lowest on-demand price per unit of capacity.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from skewserve.errors import SkewserveError

HOURS_PER_MONTH = 730.0
DEFAULT_CURVE = [0.25, 0.2, 0.18, 0.17, 0.18, 0.22, 0.35, 0.55, 0.75, 0.9, 0.97, 1.0] + [
    0.98,
    0.95,
    0.93,
    0.92,
    0.9,
    0.85,
    0.75,
    0.62,
    0.5,
    0.42,
    0.35,
    0.3,
]


class PlanInputError(SkewserveError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Measurement(_Strict):
    instance_type: str
    servers: int = Field(default=1, ge=1, description="Triton servers the measurement ran against")
    rps: float = Field(gt=0, description="requests/s sustained")
    p99_ms: float = Field(gt=0, description="p99 latency at that load")


class CapacityFile(_Strict):
    measurements: list[Measurement] = Field(min_length=1)


class RegionTraffic(_Strict):
    peak_rps: float = Field(gt=0, description="requests/s at the busiest hour")
    curve: list[float] = Field(
        default_factory=lambda: list(DEFAULT_CURVE), description="24 hourly fractions of the peak"
    )

    @field_validator("curve")
    @classmethod
    def _curve(cls, v: list[float]) -> list[float]:
        if len(v) != 24:
            raise ValueError(f"needs 24 hourly values, got {len(v)}")
        if any(not 0 <= x <= 1 for x in v) or max(v) != 1:
            raise ValueError("values are fractions of the peak: each in [0, 1], the busiest hour exactly 1")
        return v


class TrafficProfile(_Strict):
    regions: dict[str, RegionTraffic] = Field(min_length=1)


class Price(_Strict):
    on_demand: float = Field(gt=0, description="$/hour on demand")
    reserved: float = Field(gt=0, description="$/hour effective with a reservation / savings plan")
    spot: float = Field(gt=0, description="$/hour on spot (can be reclaimed)")


class PriceTable(_Strict):
    instance_types: dict[str, Price] = Field(min_length=1)
    regions: dict[str, dict[str, Price]] = Field(
        default_factory=dict, description="per-region prices overriding instance_types"
    )

    def price(self, region: str, instance_type: str) -> Price:
        regional = self.regions.get(region, {})
        if instance_type in regional:
            return regional[instance_type]
        if instance_type in self.instance_types:
            return self.instance_types[instance_type]
        known = sorted(set(self.instance_types) | set(regional))
        raise PlanInputError(
            f"no price for instance type {instance_type!r} (the prices file has {known}): pass the "
            "--instance-type the load test ran on, or add it under instance_types"
        )


class PlanOptions(_Strict):
    cache_hit_rate: float = Field(default=0.0, ge=0, lt=1, description="share of requests the caches answer")
    escalation_rate: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="share of requests (past the cache) an edge tier's cascade sends on to these servers; "
        "1 = no edge tier (docs/cascade.md)",
    )
    spot_share: float = Field(default=0.0, ge=0, le=1, description="share of elastic servers on spot")
    utilization: float = Field(default=0.7, gt=0, le=1, description="planned load / measured capacity")
    min_servers: int = Field(default=2, ge=1, description="per region, at any hour (redundancy)")
    spare_servers: int = Field(default=1, ge=0, description="autoscaler max above the planned peak")


class RegionPlan(_Strict):
    region: str
    instance_type: str
    capacity_rps: float
    price: Price
    client_rps: list[float]
    backend_rps: list[float]
    servers: list[int]
    baseline: int
    hourly_cost: list[float]
    autoscaler_min: int
    autoscaler_max: int

    @property
    def daily_cost(self) -> float:
        return sum(self.hourly_cost)

    @property
    def monthly_cost(self) -> float:
        return self.daily_cost * HOURS_PER_MONTH / 24

    @property
    def monthly_requests(self) -> float:
        return sum(self.client_rps) * 3600 * HOURS_PER_MONTH / 24


class Plan(_Strict):
    options: PlanOptions
    regions: list[RegionPlan]
    monthly_cost_without_cache: float
    monthly_cost_without_spot: float
    monthly_cost_all_on_demand: float
    monthly_cost_without_edge: float
    server_hours_per_day_without_edge: int

    @property
    def server_hours_per_day(self) -> int:
        return sum(sum(r.servers) for r in self.regions)

    @property
    def monthly_cost(self) -> float:
        return sum(r.monthly_cost for r in self.regions)

    @property
    def cost_per_hour(self) -> float:
        return self.monthly_cost / HOURS_PER_MONTH

    @property
    def cost_per_million(self) -> float:
        requests = sum(r.monthly_requests for r in self.regions)
        return self.monthly_cost / (requests / 1e6) if requests else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "monthly_cost": round(self.monthly_cost, 2),
            "cost_per_hour": round(self.cost_per_hour, 4),
            "cost_per_million_inferences": round(self.cost_per_million, 4),
            "cache_saves_per_month": round(self.monthly_cost_without_cache - self.monthly_cost, 2),
            "spot_saves_per_month": round(self.monthly_cost_without_spot - self.monthly_cost, 2),
            "all_on_demand_monthly_cost": round(self.monthly_cost_all_on_demand, 2),
            "edge": {
                "escalation_rate": self.options.escalation_rate,
                "saves_per_month": round(self.monthly_cost_without_edge - self.monthly_cost, 2),
                "server_hours_per_day": self.server_hours_per_day,
                "server_hours_per_day_saved": self.server_hours_per_day_without_edge
                - self.server_hours_per_day,
            },
            "regions": {
                r.region: {
                    "instance_type": r.instance_type,
                    "capacity_rps_per_server": r.capacity_rps,
                    "servers_per_hour": r.servers,
                    "reserved_baseline": r.baseline,
                    "autoscaler": {"min": r.autoscaler_min, "max": r.autoscaler_max},
                    "monthly_cost": round(r.monthly_cost, 2),
                }
                for r in self.regions
            },
        }


# -- inputs -----------------------------------------------------------------------------------
def _load_yaml(path: Path, model: type[BaseModel]) -> Any:
    if not path.is_file():
        raise PlanInputError(f"{path} does not exist")
    try:
        return model(**(yaml.safe_load(path.read_text()) or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise PlanInputError(f"{path}: {where}: {err['msg']}") from exc
    except yaml.YAMLError as exc:
        raise PlanInputError(f"{path} is not valid YAML: {exc}") from exc


def load_traffic(path: Path) -> TrafficProfile:
    traffic: TrafficProfile = _load_yaml(path, TrafficProfile)
    return traffic


def load_prices(path: Path) -> PriceTable:
    prices: PriceTable = _load_yaml(path, PriceTable)
    return prices


def capacity_from_measurements(measurements: list[Measurement], slo_p99_ms: float) -> dict[str, float]:
    """Best requests/s per server within the SLO, per instance type; types never within it are left out."""
    out: dict[str, float] = {}
    for m in measurements:
        if m.p99_ms <= slo_p99_ms:
            out[m.instance_type] = max(out.get(m.instance_type, 0.0), m.rps / m.servers)
    if not out:
        raise PlanInputError(
            f"no measurement meets the p99 SLO of {slo_p99_ms} ms; measure at lower load or relax --slo-p99-ms"
        )
    return out


def load_capacity(path: Path, slo_p99_ms: float) -> dict[str, float]:
    data: CapacityFile = _load_yaml(path, CapacityFile)
    return capacity_from_measurements(data.measurements, slo_p99_ms)


def capacity_from_loadtest(
    out_dir: Path, servers: int, instance_type: str, slo_p99_ms: float
) -> dict[str, float]:
    """A `skewserve loadtest` result (its locust_stats.csv) as one measurement."""
    from loadtests.report import read_stats

    stats = out_dir / "locust_stats.csv"
    if not stats.is_file():
        raise PlanInputError(
            f"{stats} does not exist; pass the --out directory of a `skewserve loadtest` run"
        )
    total = next((r for r in read_stats(out_dir / "locust") if r.name == "Aggregated"), None)
    if total is None or total.rps <= 0:
        raise PlanInputError(f"{stats} has no aggregated row with traffic")
    m = Measurement(
        instance_type=instance_type, servers=servers, rps=total.rps, p99_ms=max(total.p99_ms, 1e-9)
    )
    return capacity_from_measurements([m], slo_p99_ms)


CACHE_DOMINATED = 0.5


def escalation_from_rule(path: Path) -> float:
    """The share of requests a cascade's rule sends on to the cloud, as `skewserve cascade calibrate`
    measured it on the validation split (the rule file's validation.cascade.escalation_rate)."""
    if not path.is_file():
        raise PlanInputError(f"{path} does not exist: give the rule file `skewserve cascade calibrate` wrote")
    try:
        rate = json.loads(path.read_text())["validation"]["cascade"]["escalation_rate"]
    except (ValueError, KeyError, TypeError) as exc:
        raise PlanInputError(
            f"{path} has no validation.cascade.escalation_rate: give a rule file written by "
            "`skewserve cascade calibrate`, or pass --escalation-rate"
        ) from exc
    if not isinstance(rate, int | float) or not 0 <= rate <= 1:
        raise PlanInputError(f"{path}: escalation_rate {rate!r} is not in [0, 1]; pass --escalation-rate")
    return float(rate)


def loadtest_warnings(out_dir: Path) -> list[str]:
    """Why a load test may not measure server capacity (its summary.json, when it has one)."""
    path = out_dir / "summary.json"
    if not path.is_file():
        return [f"{path} is missing (a load test run before it was written): the cache hit rate is unknown"]
    hit = json.loads(path.read_text()).get("cache_hit_rate")
    if hit is None:
        return ["the load test ran without --metrics-url: whether the gateway's cache answered it is unknown"]
    if hit >= CACHE_DOMINATED:
        return [
            f"{100 * hit:.0f}% of the load test's requests were cache hits: its requests/s measure the "
            "cache, not the servers. Measure capacity with the cache off, or --zipf 0 and --keys larger "
            "than the run's requests"
        ]
    return []


# -- the model --------------------------------------------------------------------------------
def servers_needed(backend_rps: float, capacity_rps: float, utilization: float, min_servers: int) -> int:
    return max(min_servers, math.ceil(backend_rps / (capacity_rps * utilization) - 1e-9))


def hourly_cost(servers: int, baseline: int, price: Price, spot_share: float) -> float:
    elastic = servers - baseline
    return baseline * price.reserved + elastic * (
        spot_share * price.spot + (1 - spot_share) * price.on_demand
    )


def cheapest_type(capacity: dict[str, float], prices: PriceTable, region: str) -> str:
    return min(capacity, key=lambda t: (prices.price(region, t).on_demand / capacity[t], t))


def plan_region(
    region: str, traffic: RegionTraffic, capacity: dict[str, float], prices: PriceTable, opts: PlanOptions
) -> RegionPlan:
    itype = cheapest_type(capacity, prices, region)
    price = prices.price(region, itype)
    client = [traffic.peak_rps * f for f in traffic.curve]
    backend = [c * (1 - opts.cache_hit_rate) * opts.escalation_rate for c in client]
    servers = [servers_needed(b, capacity[itype], opts.utilization, opts.min_servers) for b in backend]
    baseline = min(servers)
    return RegionPlan(
        region=region,
        instance_type=itype,
        capacity_rps=capacity[itype],
        price=price,
        client_rps=client,
        backend_rps=backend,
        servers=servers,
        baseline=baseline,
        hourly_cost=[hourly_cost(n, baseline, price, opts.spot_share) for n in servers],
        autoscaler_min=baseline,
        autoscaler_max=max(servers) + opts.spare_servers,
    )


def _monthly(
    traffic: TrafficProfile, capacity: dict[str, float], prices: PriceTable, opts: PlanOptions
) -> float:
    return sum(plan_region(r, t, capacity, prices, opts).monthly_cost for r, t in traffic.regions.items())


def _all_on_demand(
    traffic: TrafficProfile, capacity: dict[str, float], prices: PriceTable, opts: PlanOptions
) -> float:
    """The naive bill: no cache, no edge tier, every server on demand all day."""
    no_cache = opts.model_copy(update={"cache_hit_rate": 0.0, "escalation_rate": 1.0})
    total = 0.0
    for region, t in traffic.regions.items():
        rp = plan_region(region, t, capacity, prices, no_cache)
        total += sum(n * rp.price.on_demand for n in rp.servers) * HOURS_PER_MONTH / 24
    return total


def make_plan(
    traffic: TrafficProfile, capacity: dict[str, float], prices: PriceTable, opts: PlanOptions
) -> Plan:
    for itype in capacity:
        for region in traffic.regions:
            prices.price(region, itype)  # every measured type must be priced: fail early, naming it
    without_edge = opts.model_copy(update={"escalation_rate": 1.0})
    return Plan(
        options=opts,
        regions=[plan_region(r, t, capacity, prices, opts) for r, t in traffic.regions.items()],
        monthly_cost_without_cache=_monthly(
            traffic, capacity, prices, opts.model_copy(update={"cache_hit_rate": 0.0})
        ),
        monthly_cost_without_spot=_monthly(
            traffic, capacity, prices, opts.model_copy(update={"spot_share": 0.0})
        ),
        monthly_cost_all_on_demand=_all_on_demand(traffic, capacity, prices, opts),
        monthly_cost_without_edge=_monthly(traffic, capacity, prices, without_edge),
        server_hours_per_day_without_edge=sum(
            sum(plan_region(r, t, capacity, prices, without_edge).servers) for r, t in traffic.regions.items()
        ),
    )


def plot_plan(plan: Plan, out: Path) -> Path:
    """Servers per region and cost per hour over the day."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = list(range(24))
    fig, (srv, cost) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    bottom = [0] * 24
    for r in plan.regions:
        srv.bar(hours, r.servers, bottom=bottom, label=f"{r.region} ({r.instance_type})")
        bottom = [b + n for b, n in zip(bottom, r.servers, strict=True)]
    srv.set_ylabel("Triton servers")
    srv.legend(loc="upper left")
    total = [sum(r.hourly_cost[h] for r in plan.regions) for h in hours]
    cost.step(hours, total, where="mid", color="tab:red", label="\\$ / hour")
    cost.set_ylabel("\\$ / hour")
    cost.set_xlabel("hour of day")
    cost.legend(loc="upper left")
    for ax in (srv, cost):
        ax.grid(alpha=0.3)
    fig.suptitle(
        # "\\$": a bare $ starts matplotlib's math mode
        f"skewserve plan: \\${plan.monthly_cost:,.0f}/month, \\${plan.cost_per_million:.3f} per million inferences"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
