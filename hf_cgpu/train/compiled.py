"""Start-up and steadiness of compiled runs: a fixed compile cache (a second run starts warm) and a recompile watch.

``use_compile_cache`` points inductor (and triton) at ``$HF_CGPU_CACHE/inductor`` and ``$HF_CGPU_CACHE/triton``
before anything compiles, unless the user set ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` themselves (to
anything but inductor's default, which importing transformers writes into the environment); torch's default
(``/tmp/torchinductor_$USER``) goes with ``/tmp`` on many machines and fresh containers, so a second run compiled
again. FX graph and AOTAutograd caches (on by default in torch 2.13) live in the inductor directory.

``RecompileWatch`` counts dynamo's recompilations (a code object compiled again because a guard failed: a new shape
with ``dynamic=False``, grad mode, ``model.train()``/``eval()``, a changed Python attribute) and logs one warning line
per recompile naming the function and the first failed guard. The count goes to ``all_results.json`` as
``recompiles``. It listens to dynamo's ``recompiles`` log artifact (``TORCH_LOGS=recompiles``): the message dynamo
already builds, nothing patched; when the user did not ask for that artifact it is kept off stderr.
"""

from __future__ import annotations

import logging
import os

from ..paths import cache_dir

RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
"""The logger of dynamo's ``recompiles`` artifact (torch 2.13: ``getArtifactLogger('torch._dynamo.guards', ...)``)."""


def use_compile_cache(log=print) -> dict[str, str]:
    """Set ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` under hf_cgpu's cache where the user set neither;
    returns the two directories in use and logs them once."""
    root = cache_dir()
    chosen = {}
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        given = os.environ.get(var)
        if given and not (var == "TORCHINDUCTOR_CACHE_DIR" and given == _torch_default()):
            chosen[var] = given
            continue
        path = root / sub
        path.mkdir(parents=True, exist_ok=True)
        os.environ[var] = chosen[var] = str(path)
    log(f"compile cache: {chosen['TORCHINDUCTOR_CACHE_DIR']} (inductor), {chosen['TRITON_CACHE_DIR']} (triton); "
        "a second run of the same model starts warm (set TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR to move them)")
    return chosen


def _torch_default() -> str:
    """Inductor's own default; importing transformers or diffusers already writes it into the environment (inductor's
    ``cache_dir()`` stores what it resolved), so that value is torch's choice, not the user's."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # pragma: no cover - another torch layout
        return ""
    return os.path.abspath(default_cache_dir())


class _Handler(logging.Handler):
    def __init__(self, watch: RecompileWatch):
        super().__init__(logging.DEBUG)
        self.watch = watch

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.watch._seen(record.getMessage())
        except Exception:  # a logging handler must never break the compile it reports on
            pass


def describe(message: str) -> tuple[str, str]:
    """(function, first failed guard) of dynamo's recompile message:
    ``Recompiling function forward in /x.py:12\\n    triggered by the following guard failure(s):\\n    - 0/0: ...``."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    head = lines[0] if lines else message
    function = head.removeprefix("Recompiling function ").strip()
    reasons = [line.removeprefix("- ").strip() for line in lines[1:] if line.startswith("-")]
    return function, (reasons[0] if reasons else "reason not given")


class RecompileWatch:
    """Counts recompilations while installed (a context manager, or ``install``/``close``); ``step`` (set by the
    loop) goes into each warning line."""

    def __init__(self, log=print):
        self.log, self.count, self.events, self.step = log, 0, [], None
        self._handler, self._enabled_by_us, self._old = None, False, None

    def install(self) -> RecompileWatch:
        if self._handler is not None:
            return self
        import torch._logging._internal as internal  # noqa: F401  (registers the artifact loggers)

        state = internal.log_state
        logger = logging.getLogger(RECOMPILES_LOGGER)
        self._enabled_by_us = not state.is_artifact_enabled("recompiles")
        self._old = (logger.level, logger.propagate)
        if self._enabled_by_us:
            state.enable_artifact("recompiles")  # dynamo formats and logs the reasons only when this is on
            logger.propagate = False  # not asked for on stderr: our one warning line says it
        if logger.getEffectiveLevel() > logging.DEBUG:
            logger.setLevel(logging.DEBUG)
        self._handler = _Handler(self)
        logger.addHandler(self._handler)
        return self

    def close(self) -> None:
        if self._handler is None:
            return
        import torch._logging._internal as internal

        logger = logging.getLogger(RECOMPILES_LOGGER)
        logger.removeHandler(self._handler)
        logger.setLevel(self._old[0])
        logger.propagate = self._old[1]
        if self._enabled_by_us:
            internal.log_state.artifact_names.discard("recompiles")
        self._handler = None

    def __enter__(self) -> RecompileWatch:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.close()

    def _seen(self, message: str) -> None:
        self.count += 1
        function, reason = describe(message)
        self.events.append({"step": self.step, "function": function, "reason": reason})
        where = f" after step {self.step}" if self.step is not None else " during the first step"
        self.log(f"warning: torch.compile recompiled {function}{where} (recompile {self.count}): {reason}; a "
                 "recompile costs compile time and a guard that keeps failing falls back to eager after "
                 "torch._dynamo.config.recompile_limit; TORCH_LOGS=recompiles_verbose shows every failed guard")


def first_step_line(seconds: float, compiled: bool) -> str:
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    what = (f"compile included; a warm cache in {cache} makes it shorter" if compiled and cache else
            "compile included" if compiled else "no compile")
    return f"start-up: first optimizer step done {seconds:.1f} s after the run started ({what})"

