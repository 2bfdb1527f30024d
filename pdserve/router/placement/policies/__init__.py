"""Placement policies beyond the two in router.placement.base: random, power-of-two and
prefix-aware (baselines), network-aware and its parts (cost model, search, split, calibration).

Each is built by name through router.placement.registry (`make_policy`, `build_policy`). This
package imports nothing, so that importing one policy module runs no other.
"""
