"""The chained optimizer's state keyed by role (dense, expert, engram) instead of position: the
body of the ``chained_optimizer_by_role`` patch (``runtime/patches.py``), so that a checkpoint
loads across expert-parallel sizes, where megatron's optimizer chain changes shape.
"""

from __future__ import annotations

import functools

import torch

# With this flag in the metadata of ``ChainedOptimizer.sharded_state_dict``, the chain's state is
# keyed by role instead of position (see `key_chain_by_role`). Checkpoints record it in their
# content metadata, so a loader requests a checkpoint's optimizer state in the layout it was saved.
CHAIN_BY_ROLE = "engram_chain_by_role"
# The ``chain_role`` of the Engram table optimizer (training/engram_optimizer.py): its state's key
# in the chain, and how checkpoint code tells it from megatron's optimizers without importing it.
ENGRAM_CHAIN_ROLE = "engram"
# The step counts of a megatron optimizer's state: torch Adam's per-group "step" (the distributed
# optimizer puts it in its param_groups) and the common per-parameter step of the others.
_STEP_KEYS = ("step", "common_step")


def chain_roles(optimizers) -> list[str]:
    """The role of each optimizer of a chain: ``engram`` (an optimizer that declares
    ``chain_role``), ``expert`` (megatron's optimizer of expert-parallel parameters) or
    ``dense``; a repeated role gets its position in the chain appended (one dense optimizer per
    model chunk when megatron overlaps the parameter gather with the optimizer step)."""
    roles = []
    for position, optimizer in enumerate(optimizers):
        role = getattr(optimizer, "chain_role", None)
        if role is None:
            groups = getattr(optimizer, "param_groups", None) or []
            expert = bool(groups) and all(g.get("is_expert_parallel", False) for g in groups)
            role = "expert" if expert else "dense"
        roles.append(role if role not in roles else f"{role}{position}")
    return roles


def _step_slots(state):
    """(container, key) of every step count in a megatron optimizer's (loaded) state dict."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key in _STEP_KEYS and not isinstance(value, (dict, list)):
                yield state, key
            else:
                yield from _step_slots(value)
    elif isinstance(state, list):
        for value in state:
            yield from _step_slots(value)


def _paths_to(state, name: str, path=()):
    """Key paths (through dicts only) of every entry called ``name`` in ``state``."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == name:
                yield (*path, key)
            else:
                yield from _paths_to(value, name, (*path, key))


def _fill_from_request(request, loaded):
    """``request`` (a sharded state dict) with its sharded leaves taken from ``loaded`` (what
    dist_checkpointing returned at the same place) and its other leaves as requested."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if isinstance(request, ShardedBase):
        return loaded
    if isinstance(request, LocalNonpersistentObject):
        return request.unwrap()
    if isinstance(request, dict):
        return {k: _fill_from_request(v, loaded.get(k) if isinstance(loaded, dict) else None)
                for k, v in request.items()}
    if isinstance(request, list):
        at = loaded if isinstance(loaded, list) and len(loaded) == len(request) else [None] * len(request)
        return [_fill_from_request(v, x) for v, x in zip(request, at)]
    return request


def _state_for_missing_role(role: str, request, loaded_roles: dict, saved_roles: list):
    """The state of a megatron optimizer whose role the checkpoint lacks: EP 1 keeps expert
    parameters in the dense optimizer, EP > 1 in their own. Their tensors are in the checkpoint
    under the parameters' keys whatever the role; what only the role held (the step count) is
    taken from the other megatron role, which stepped in lockstep."""
    donors = [r for r in saved_roles if r.rstrip("0123456789") in ("dense", "expert")]
    if not donors or role.rstrip("0123456789") not in ("dense", "expert"):
        raise RuntimeError(
            f"the checkpoint's optimizer state has the roles {saved_roles}, but this run's "
            f"optimizer chain needs {role!r}, which no saved role can stand for"
        )
    steps = {float(c[k]) for c, k in _step_slots(loaded_roles[donors[0]]) if c[k] is not None}
    if len(steps) > 1:
        raise RuntimeError(f"the checkpoint's {donors[0]!r} optimizer holds several steps {steps}")
    state = _fill_from_request(request, loaded_roles.get(role))
    # The common per-parameter step of megatron's non-distributed optimizers is saved only when
    # non-zero, so a freshly requested state may lack it: take the donor's place for it.
    donor = loaded_roles[donors[0]]
    for path in _paths_to(donor, "common_step"):
        parent, value = state, donor
        for part in path[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        for part in path:
            value = value[part]
        if isinstance(parent, dict) and path[-1] not in parent:
            parent[path[-1]] = value
    for container, key in _step_slots(state):
        value = container[key]
        if value is None or not steps:
            continue
        step = next(iter(steps))
        container[key] = (torch.full_like(value, step) if isinstance(value, torch.Tensor)
                          else type(value)(step))
    return state


def key_chain_by_role(ctx) -> None:
    """``ChainedOptimizer`` keys its state by position (``chained_<i>.`` prefixes and integer
    keys), and its chain changes shape with expert parallelism: megatron gives expert
    parameters an optimizer of their own only when ``expert_model_parallel_size > 1``. With
    `CHAIN_BY_ROLE` in the metadata, the tensors keep only their parameters' keys (megatron's
    own ``chained_optim_avoid_prefix``, unique across the chain) and each optimizer's other
    state (param groups, step counts) is keyed by its role (`chain_roles`). Loading maps the
    saved roles onto this run's; a role the checkpoint lacks is built as
    `_state_for_missing_role` says, a saved role this run lacks is dropped. Without the flag,
    megatron's behaviour is unchanged (checkpoints saved by position).
    Tracks megatron-core 0.16.1 and 0.19.2 ``ChainedOptimizer.sharded_state_dict`` and
    ``load_state_dict``.
    """
    from megatron.core.optimizer import ChainedOptimizer

    original_sharded = ChainedOptimizer.sharded_state_dict
    original_load = ChainedOptimizer.load_state_dict

    @functools.wraps(original_sharded)
    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, **kwargs):
        metadata = kwargs.get("metadata") or {}
        if not metadata.get(CHAIN_BY_ROLE):
            return original_sharded(self, model_sharded_state_dict, is_loading, **kwargs)
        kwargs["metadata"] = {**metadata, "chained_optim_avoid_prefix": True}
        self._synchronize_steps()
        roles = chain_roles(self.chained_optimizers)
        state = {
            role: optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
            for role, optimizer in zip(roles, self.chained_optimizers)
        }
        if is_loading:  # the layout of each role's state, for a role the checkpoint lacks
            self._role_requests = state
        return {"roles": roles, **state}

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        if not (isinstance(state_dict, dict) and isinstance(state_dict.get("roles"), list)):
            return original_load(self, state_dict)
        saved_roles = state_dict["roles"]
        requests = getattr(self, "_role_requests", None) or {}
        roles = chain_roles(self.chained_optimizers)
        # Missing roles first: loading a saved role consumes its step counts (megatron's
        # non-distributed optimizers pop ``common_step``), which a missing role is given.
        states = {}
        for role in roles:
            if role in saved_roles:
                states[role] = state_dict[role]
            elif role not in requests:
                raise RuntimeError(f"optimizer role {role!r} was not requested for this load")
            else:
                states[role] = _state_for_missing_role(role, requests[role], state_dict, saved_roles)
        for role, optimizer in zip(roles, self.chained_optimizers):
            optimizer.load_state_dict(states[role])
        self._role_requests = None
        self._synchronize_steps()

    ctx.set(ChainedOptimizer, "sharded_state_dict", sharded_state_dict)
    ctx.set(ChainedOptimizer, "load_state_dict", load_state_dict)


def chain_keyed_by_position() -> bool:
    """megatron's ChainedOptimizer has no role keys of its own (the patch is still needed)."""
    import inspect

    from megatron.core.optimizer import ChainedOptimizer

    return "chained_{optimizer_idx}" in inspect.getsource(ChainedOptimizer.sharded_state_dict)
