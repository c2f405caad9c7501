"""Base configuration: every setting of a run, with defaults; model configs override it.

The table itself lives in the library, :func:`gift_jax.training.defaults.default_config` (one
table of defaults, with a comment on every setting); this file is the name the other configs
start from. The defaults are the ``tiny`` byte-level model (vocab 256; 857,216 parameters).
"""

from gift_jax.training.defaults import default_config as get_config  # noqa: F401
