"""GatheredParameters: the full params inside a `with` block (defined in
_params, which copies partitioned params under it)."""
from ._params import GatheredParameters

__all__ = ["GatheredParameters"]
