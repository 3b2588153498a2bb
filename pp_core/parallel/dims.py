"""The parallel layout of a run, decided once: :class:`ParallelDims`.

One frozen value holds every degree - ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``, ``ep`` and
``sequence_parallel`` (the YAML keys ``distributed.{pp_size, dp_replicate, dp_shard, tp_size,
ep_size, sequence_parallel}``) - and everything derived from them: the world size, the divisors
(``dp``, ``seq_len_divisor``), the ranks one machine runs, the problems (one line each, naming
the key and the fix) and, in :meth:`ParallelDims.build`, every device mesh and process group the
run uses. Nothing else multiplies degrees, builds a mesh or group, or lists the degrees' YAML
names (:attr:`ParallelDims.KEYS`, :meth:`~ParallelDims.to_keys`, :meth:`~ParallelDims.from_keys`;
torchtitan's ``ParallelDims``, in accelerate's small form); add the next degree here.

The mesh is ``("pp", "dp_replicate", "dp_shard", "tp")``: pp outermost, tp innermost (a tp
group's per-layer collectives stay between neighbouring ranks, on one node; only activations
cross nodes). Expert parallelism draws its ranks from the data-parallel ones, as torchtitan and
Megatron do: the dp ranks ``0..dp-1`` (``dp_rank = replicate_index * dp_shard + shard_index``)
of one pipeline rank and tp rank are cut into contiguous blocks of ``ep``; each block is an ep
group, and the ranks at the same position of every block (they hold the same experts) form the
expert-dp group (``dp / ep`` ranks that average the experts' gradients).

Pure until :meth:`~ParallelDims.build`: importing this module imports no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

from pp_core.config import DEGREE_KEYS
from pp_core.errors import ConfigError

__all__ = ["ParallelDims", "Meshes", "ExpertGroups", "MESH_DIMS", "build_expert_groups",
           "background_group"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")



@dataclass(frozen=True)
class ParallelDims:
    """Every parallel degree of a run (each 1 when unused); see the module docstring."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    KEYS: ClassVar[dict[str, str]] = DEGREE_KEYS
    """Each degree -> its key under ``distributed:`` in a pipeline file (the one list of them:
    the layout every plan object and checkpoint record carries, the degrees ``--world`` searches
    and ``--set`` may fix)."""

    @classmethod
    def of(cls, distributed: Any) -> "ParallelDims":
        """From a ``distributed`` section: a :class:`~pp_core.app.spec.sections.DistributedSpec`
        or a mapping of its keys (missing keys: 1; ``dp_size`` alone means ``dp_replicate``)."""
        get = distributed.get if isinstance(distributed, Mapping) else \
            (lambda key, default=None: getattr(distributed, key, default))
        values = {dim: get(key, None) for dim, key in cls.KEYS.items()}
        replicate, shard = values["dp_replicate"] or 1, values["dp_shard"] or 1
        dp_size = get("dp_size", None)
        if dp_size not in (None, 1) and replicate * shard == 1:
            replicate = dp_size
        return cls(int(values["pp"] or 1), int(replicate), int(shard), int(values["tp"] or 1),
                   int(values["ep"] or 1), bool(get("sequence_parallel", False)))

    @classmethod
    def from_keys(cls, keys: Mapping[str, Any]) -> "ParallelDims":
        """From the degrees by their YAML names (``{"pp_size": 2, "tp_size": 2}``; a missing
        key: 1); other keys are ignored, ``sequence_parallel`` read when there."""
        return cls(**{dim: int(keys.get(key) or 1) for dim, key in cls.KEYS.items()},
                   sequence_parallel=bool(keys.get("sequence_parallel", False)))

    def to_keys(self) -> dict[str, int]:
        """Every degree by its YAML name, in :attr:`KEYS` order (as plan objects and checkpoint
        records carry them): ``{"pp_size": 2, "dp_replicate": 1, ...}``."""
        return {key: getattr(self, dim) for dim, key in self.KEYS.items()}

    # ------------------------------------------------------------------ derived figures
    @property
    def dp(self) -> int:
        """The data-parallel degree ``dp_replicate * dp_shard`` (the YAML's ``dp_size``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """Every rank of the job: ``pp * dp_replicate * dp_shard * tp``."""
        return self.pp * self.dp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """The sizes of :data:`MESH_DIMS`."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def seq_len_divisor(self) -> int:
        """What a sequence length must divide by: ``tp`` with sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel else 1

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts: ``dp / ep``."""
        return self.dp // self.ep if self.ep and self.dp % self.ep == 0 else 1

    def factors(self, expanded: bool = False) -> list[tuple[str, int]]:
        """``[(key, degree)]`` whose product is the world size: ``pp_size``, ``dp_size`` (or
        ``dp_replicate`` and ``dp_shard`` when ``expanded``), and ``tp_size`` unless it is 1."""
        dp = [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)] if expanded \
            else [("dp_size", self.dp)]
        return [("pp_size", self.pp)] + dp + ([("tp_size", self.tp)] if self.tp > 1 else [])

    def formula(self, expanded: bool = False) -> str:
        """``"pp_size * dp_size * tp_size"`` (the keys the world size multiplies)."""
        return " * ".join(key for key, _ in self.factors(expanded))

    def figures(self, expanded: bool = False) -> str:
        """``"2 * 2 * 2"`` (their values, in the same order)."""
        return " * ".join(str(value) for _, value in self.factors(expanded))

    def largest_key(self) -> str:
        """The key of the largest factor of the world size (what to shrink first)."""
        return max(self.factors(), key=lambda item: item[1])[0]

    def describe(self) -> str:
        """``"pp 2 x dp 2 x tp 2"`` for messages (tp and ep only when above 1)."""
        text = f"pp {self.pp} x dp {self.dp}"
        text += f" x tp {self.tp}" if self.tp > 1 else ""
        return text + (f", ep {self.ep}" if self.ep > 1 else "")

    def local_ranks(self, nnodes: int = 1, nproc_per_node: Optional[int] = None,
                    environ: Optional[Mapping[str, str]] = None) -> int:
        """How many ranks run on this machine: torchrun's ``LOCAL_WORLD_SIZE`` inside a launched
        job, else ``nproc_per_node``, else every rank of the job over ``nnodes``."""
        env = os.environ if environ is None else environ
        if "LOCAL_WORLD_SIZE" in env:
            return int(env["LOCAL_WORLD_SIZE"])
        if nproc_per_node:
            return nproc_per_node
        return self.world_size // nnodes

    # ------------------------------------------------------------------ problems
    def problems(self, nnodes: int = 1, nproc_per_node: Optional[int] = None,
                 prefix: str = "distributed") -> list[str]:
        """What keeps these degrees from a run on ``nnodes`` machines: one line per problem,
        each naming its key under ``prefix`` and the fix; none when they fit."""
        found = []
        if self.dp % self.ep:
            found.append(f"{prefix}.ep_size: expected a divisor of the data-parallel size "
                         f"dp_replicate * dp_shard = {self.dp}, found {self.ep}; "
                         f"expert-parallel ranks are drawn from the dp ranks")
        world, formula = self.world_size, self.formula()
        if nproc_per_node is None and world % nnodes:
            found.append(f"{prefix}.nnodes: {formula} = {world} ranks cannot be shared evenly by "
                         f"nnodes={nnodes}; use an nnodes that divides {world}")
        elif nproc_per_node is not None and nproc_per_node * nnodes != world:
            found.append(f"{prefix}.nproc_per_node: expected nnodes * nproc_per_node = "
                         f"{formula} = {world}, found {nnodes} * {nproc_per_node}")
        if self.sequence_parallel and self.tp == 1:
            found.append(f"{prefix}.sequence_parallel: shards activations over the tp ranks, "
                         f"found tp_size = 1; set {prefix}.tp_size > 1 or drop "
                         f"sequence_parallel")
        return found

    def world_size_problem(self, world: int, found: str = "{} ranks joined") -> Optional[str]:
        """The line saying that ``world`` ranks were ``found`` (a format with one ``{}``) where
        the degrees need another number; ``None`` when they agree."""
        if world == self.world_size:
            return None
        return (f"{found.format(world)}, but distributed.{self.formula(expanded=True)} = "
                f"{self.figures(expanded=True)} = {self.world_size}")

    # ------------------------------------------------------------------ the meshes
    def build(self, device_type: str) -> "Meshes":
        """Every mesh and group of the run, over every rank of the default process group
        (every rank calls it, in the same order): the ``(pp, dp_replicate, dp_shard, tp)``
        device mesh, its sub-meshes, and with ``ep > 1`` this rank's :class:`ExpertGroups`.

        :raises ConfigError: the degrees do not fit (:meth:`problems`) or the group has
            another number of ranks than :attr:`world_size`.
        """
        import torch.distributed as dist  # lazy: torch, only when a rank lays itself out
        from torch.distributed.device_mesh import init_device_mesh  # lazy: as above

        problems = self.problems()
        mismatch = self.world_size_problem(dist.get_world_size(), "the process group has {} ranks")
        if problems or mismatch:
            raise ConfigError("; ".join(problems + ([mismatch] if mismatch else [])))
        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIMS)
        experts = build_expert_groups(mesh.mesh.reshape(self.pp, self.dp, -1), self.ep) \
            if self.ep > 1 else None
        return Meshes(self, mesh, experts)


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel groups: ``ep_group`` (the ranks its experts' tokens travel
    between), ``expert_dp_group`` (the ranks holding the same experts; ``None`` when
    ``ep_size == dp_size``), ``ep_rank``, ``ep_size``, ``dp_size``."""

    ep_group: Any
    expert_dp_group: Any
    ep_rank: int
    ep_size: int
    dp_size: int


def build_expert_groups(rank_grid, ep_size: int) -> ExpertGroups:
    """Every ep and expert-dp group (every rank calls this, in the same order); this rank's.

    :param rank_grid: the global ranks laid out ``[pp, dp, ...]`` (a DeviceMesh's ``mesh``
        tensor reshaped so the data-parallel dims are flattened into dim 1); trailing dims
        (tensor parallel) get groups of their own.
    :param ep_size: ranks per ep group; must divide the dp size.
    """
    import torch.distributed as dist  # lazy: torch, only when a rank lays itself out

    grid = rank_grid.reshape(rank_grid.shape[0], rank_grid.shape[1], -1)
    pp, dp, rest = grid.shape
    if ep_size < 1 or dp % ep_size:
        raise ConfigError(f"distributed.ep_size={ep_size} must divide the data-parallel size "
                          f"dp_replicate * dp_shard = {dp}; expert-parallel ranks are drawn "
                          f"from the dp ranks")
    me = dist.get_rank()
    found = {}
    for p in range(pp):
        for t in range(rest):
            ranks = grid[p, :, t].tolist()
            for block in range(dp // ep_size):
                members = ranks[block * ep_size:(block + 1) * ep_size]
                group = dist.new_group(members) if ep_size > 1 else None
                if me in members:
                    found["ep"], found["ep_rank"] = group, members.index(me)
            for position in range(ep_size):
                members = ranks[position::ep_size]
                group = dist.new_group(members) if len(members) > 1 else None
                if me in members:
                    found["dp"] = group
    return ExpertGroups(found["ep"], found["dp"], found["ep_rank"], ep_size, dp)


def background_group():
    """A gloo group of every rank for work off the training path (``checkpoint.async``'s
    background writes, :mod:`pp_core.checkpoint.async_save`): its collectives never interleave
    with the step's. Collective: every rank calls it once, at the same point."""
    import torch.distributed as dist  # lazy: this module imports no torch

    return dist.new_group(backend="gloo")


@dataclass(frozen=True)
class Meshes:
    """What :meth:`ParallelDims.build` made: ``mesh`` (every rank), its sub-meshes ``pp``,
    ``dp`` (``("dp_replicate", "dp_shard")``) and ``tp``, ``experts`` (``None`` at ep 1), and
    ``loss_group``, the ranks a loss counts tokens over. ``build_pipeline(..., meshes=)`` and
    :func:`pp_core.parallel.compose.parallelize` take it whole: a new degree adds a mesh here,
    not a keyword to them."""

    dims: ParallelDims
    mesh: Any
    experts: Optional[ExpertGroups] = None

    @property
    def pp(self):
        return self.mesh["pp"]

    @property
    def dp(self):
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def tp(self):
        return self.mesh["tp"]

    @property
    def pp_rank(self) -> int:
        return self.pp.get_local_rank()

    @property
    def dp_rank(self) -> int:
        """``replicate_index * dp_shard + shard_index``."""
        return (self.mesh["dp_replicate"].get_local_rank() * self.dims.dp_shard
                + self.mesh["dp_shard"].get_local_rank())

    @property
    def ep_group(self):
        return None if self.experts is None else self.experts.ep_group

    @property
    def loss_group(self):
        """The ranks a token-normalised loss counts the step's valid tokens over (the dp
        ranks: each holds a share of the global batch); ``None`` when there is one."""
        return self.dp if self.dims.dp > 1 else None

    def data_parallel_mesh(self):
        """The sub-mesh torch's dp engines run on: ``dp_shard`` (FSDP2), ``dp_replicate``
        (replicas only) or both (HSDP)."""
        replicate, shard = self.dims.dp_replicate, self.dims.dp_shard
        if replicate > 1 and shard > 1:
            return self.dp
        return self.mesh["dp_shard" if shard > 1 else "dp_replicate"]
