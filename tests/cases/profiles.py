"""Synthetic model profiles for the planner's tests: eight units of unequal weight, profiled at
microbatch sizes 1, 2 and 4 (pure data, no torch run)."""

from pp_core.planning.costs import ModelProfile, UnitCost

MiB = 2 ** 20


def unit(i, weight, mbs):
    return UnitCost(fqns=(f"layers.{i}",), forward_s=weight * mbs * 1e-3,
                    backward_s=2 * weight * mbs * 1e-3, input_grad_s=weight * mbs * 1e-3,
                    weight_grad_s=weight * mbs * 1e-3, activation_bytes=int(weight * mbs * MiB),
                    param_bytes=int(weight * 4 * MiB), output_bytes=mbs * 64 * 1024)


def profile(mbs, weights=(3, 1, 2, 1, 2, 1, 2, 3)):
    return ModelProfile(mbs, tuple(unit(i, w, mbs) for i, w in enumerate(weights)),
                        p2p_latency_s=1e-5, p2p_bytes_per_s=1e9,
                        optimizer_step_bytes_per_param_byte=0.0)  # activations decide here


PROFILES = {m: profile(m) for m in (1, 2, 4)}
