"""The XLA:CPU code generation the suite compiles with, and the default it pins where a test
checks a property of the code users run.

The suite compiles at LLVM optimization level 0 without the expensive passes and, where the
installed XLA still has them (jaxlib 0.10; jaxlib 0.12 removed them), with XLA:CPU's elemental
emitters instead of its MLIR fusion emitters (:data:`SUITE_CODEGEN`, set for every process of a
run by ``conftest.py`` through ``XLA_FLAGS``): it compiles hundreds of small programs and runs
each a few times, so the backend's code generation costs more than the code saves (level 0
took a fifth of the suite's CPU time off; the elemental emitters another 43 % on jaxlib 0.10).
The HLO passes, the partitioner and the collectives are the same either way, so replica
identity, wire bytes and the trained values are checked as they are. What changes is the
floating-point code emitted for a fusion (e.g. whether a multiply-add is contracted into an
FMA, or how a quotient is formed): a test that asserts two *different* programs agree bit for
bit (a Pallas kernel and its XLA reference, a codec and its numpy oracle) compiles at
:data:`DEFAULT_CODEGEN` with :func:`at_default_codegen`; at level 0, 8 of the 10
dequantize-accumulate cases differ in up to 2.8 % of the elements on jax 0.12, and with the
elemental emitters one of nvfp4's 640 oracle values lands on the other side of a rounding tie.
So does a regression test of a crash that was in the default codegen (jaxlib 0.10's XLA:CPU
dot).

Whether XLA has the elemental emitters is asked once per run, by the first process that
imports this module (a Python that starts JAX with the flag; about 2 s); the answer travels to
pytest-xdist's workers and the scripts the tests start in ``GIFT_JAX_SUITE_CODEGEN``.
"""

import json
import os
import subprocess
import sys

#: LLVM level 0 without the expensive passes: every XLA.
_LEVEL_0 = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
#: The elemental emitters, where the installed XLA has the option.
_ELEMENTAL_EMITTERS = {"xla_cpu_use_fusion_emitters": False}
#: XLA's defaults of the options above (``tests/test_kernels.py`` checks they are).
_XLA_DEFAULTS = {"xla_backend_optimization_level": 3,
                 "xla_llvm_disable_expensive_passes": False,
                 "xla_cpu_use_fusion_emitters": True}
_ENV = "GIFT_JAX_SUITE_CODEGEN"


def xla_flags(options: dict) -> str:
    """``options`` as ``XLA_FLAGS`` text: ``--name=value`` each, booleans lower case."""
    return " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in options.items())


def start_jax(flags: str) -> subprocess.CompletedProcess:
    """A Python (this one) that starts JAX's CPU backend with ``XLA_FLAGS=flags`` and exits.

    XLA reads its flags there: an unknown flag ends the process with an error, and
    ``--help`` prints every flag with its default (on stderr) and ends it.

    Args:
      flags: the ``XLA_FLAGS`` text.

    Returns:
      The finished process (text output captured).
    """
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, text=True, timeout=300)


def _xla_accepts(options: dict) -> bool:
    """Whether this Python's XLA accepts ``options`` (a process starting JAX with them as
    ``XLA_FLAGS`` exits cleanly)."""
    return start_jax(xla_flags(options)).returncode == 0


def _suite_codegen() -> dict:
    """The suite's options: read from ``GIFT_JAX_SUITE_CODEGEN``, else decided (asking XLA
    whether it has the elemental emitters) and put there for the processes this one starts."""
    if _ENV not in os.environ:
        options = {**_LEVEL_0, **(_ELEMENTAL_EMITTERS if _xla_accepts(_ELEMENTAL_EMITTERS)
                                  else {})}
        os.environ[_ENV] = json.dumps(options)
    return json.loads(os.environ[_ENV])


#: What the suite compiles with (``conftest.py`` passes it to every process as ``XLA_FLAGS``).
SUITE_CODEGEN = _suite_codegen()

#: XLA's defaults for the same options.
DEFAULT_CODEGEN = {name: _XLA_DEFAULTS[name] for name in SUITE_CODEGEN}


def at_default_codegen(fn, *args, static_argnums=()):
    """``fn(*args)`` jitted and compiled at XLA's default code generation (not the suite's).

    Args:
      fn: the function.
      *args: its arguments (``None`` allowed: an absent optional array).
      static_argnums: positions of hashable static arguments, as ``jax.jit``'s.

    Returns:
      ``fn(*args)``.
    """
    import jax  # not at import: conftest imports this module before JAX initialises

    compiled = jax.jit(fn, static_argnums=static_argnums).lower(*args).compile(DEFAULT_CODEGEN)
    return compiled(*(a for i, a in enumerate(args) if i not in static_argnums))
