"""The grammar compile sandbox: a process that compiles one constraint at a time, under limits.

``grammar_pool`` runs this file as a script (``python -I grammar_worker.py``), never as part of
the ``worker`` package (whose ``__init__`` imports torch). It imports only what compiling needs:
xgrammar's compiler and tokenizer-info modules, with torch and transformers kept out (xgrammar
compiles without either; its package ``__init__`` would import both). Measured on the 2-core
box: 0.9 s and 55 MB to start, where ``import xgrammar`` takes 5-22 s and 270 MB. Should that
ever fail (another xgrammar version), the pool starts its workers in "full" mode instead.

After its imports the process caps its address space at its current size plus the memory
budget (RLIMIT_AS), so a compile that needs more fails with ``std::bad_alloc`` instead of
growing; it dies with its parent (PR_SET_PDEATHSIG) and, as a fuse, its CPU time per job is
capped too (RLIMIT_CPU); the parent's wall-clock kill comes first.

Protocol, one JSON object per line: the worker says ``{"hello": pid}``; each job
``{"id", "kind", "spec", "info_key", "info"?, "cpu_s"}`` gets ``{"id", "started": true}`` once
the tokenizer info is loaded (the compile clock starts there), then ``{"id", "ok": true}`` or
``{"id", "error": "invalid" | "memory", "message"}``. After a memory error the worker exits
(its heap is not trusted further); the pool replaces it.

``compile_spec`` is also how the parent compiles a constraint once this sandbox vouched for it.
"""

from __future__ import annotations

import json
import os
import sys
import types
from collections import OrderedDict
from typing import Any

# A compile whose allocation failed: xgrammar's C++ raises std::bad_alloc (as RuntimeError).
_OUT_OF_MEMORY = ("bad_alloc", "out of memory")
INFOS_KEPT = 4


def compile_spec(compiler: Any, kind: str, spec: str) -> Any:
    """The xgrammar ``CompiledGrammar`` for one constraint (``StructuredOutputsParams`` kind/spec)."""
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec))
        )
    if "::=" in spec:
        return compiler.compile_grammar(spec)
    return compiler.compile_lark(spec)


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or any(s in str(exc) for s in _OUT_OF_MEMORY)


# -- the child process -------------------------------------------------------------------------


def _transformers_stub() -> types.ModuleType:
    """What xgrammar.tokenizer_info imports from transformers (only for ``from_huggingface``)."""
    mod = types.ModuleType("transformers")
    base = type("PreTrainedTokenizerBase", (), {})
    fast = type("PreTrainedTokenizerFast", (base,), {})
    mod.__dict__.update(PreTrainedTokenizerBase=base, PreTrainedTokenizerFast=fast)
    return mod


def _import_xgrammar(lean: bool) -> tuple[Any, Any]:
    """(GrammarCompiler, TokenizerInfo): lean = without xgrammar's package __init__, torch, transformers."""
    if lean:
        import importlib.util

        found = importlib.util.find_spec("xgrammar")
        if found is None or not found.submodule_search_locations:
            raise ImportError("xgrammar is not installed")
        pkg = types.ModuleType("xgrammar")
        pkg.__path__ = list(found.submodule_search_locations)
        pkg.__spec__ = found
        sys.modules["torch"] = None  # type: ignore[assignment]  # tvm_ffi imports it only if present
        sys.modules["xgrammar"] = pkg
        sys.modules["transformers"] = _transformers_stub()
        import xgrammar.load_binding  # noqa: F401 - the C++ library, as xgrammar's __init__ loads it
    from xgrammar.compiler import GrammarCompiler
    from xgrammar.tokenizer_info import TokenizerInfo

    return GrammarCompiler, TokenizerInfo


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass  # elsewhere: stdin's EOF ends an idle worker, RLIMIT_CPU a busy one
    if os.getppid() != parent:
        os._exit(0)


def _vm_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmSize not in /proc/self/status")


def _limit(what: int, soft: int) -> None:
    import resource

    _, hard = resource.getrlimit(what)
    resource.setrlimit(what, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _cap_cpu(seconds: float) -> None:
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    _limit(resource.RLIMIT_CPU, int(used.ru_utime + used.ru_stime + seconds) + 1)


class _Sandbox:
    def __init__(self, compiler_cls: Any, info_cls: Any) -> None:
        self._compiler_cls = compiler_cls
        self._info_cls = info_cls
        self._compilers: OrderedDict[str, Any] = OrderedDict()

    def compiler(self, job: dict[str, Any]) -> Any:
        key = job["info_key"]
        c = self._compilers.get(key)
        if c is None:
            info = self._info_cls.deserialize_json(job["info"])
            c = self._compilers[key] = self._compiler_cls(info, max_threads=1, cache_enabled=False)
            while len(self._compilers) > INFOS_KEPT:
                self._compilers.popitem(last=False)
        self._compilers.move_to_end(key)
        return c

    def run(self, job: dict[str, Any], send: Any) -> bool:
        """One job; False when the worker must exit (its memory ran out)."""
        compiler = self.compiler(job)
        send({"id": job["id"], "started": True})
        _cap_cpu(job["cpu_s"])
        try:
            compile_spec(compiler, job["kind"], job["spec"])
        except Exception as exc:  # noqa: BLE001 - every failure is the constraint's, reported
            oom = is_out_of_memory(exc)
            text = str(exc).strip() or type(exc).__name__
            send({"id": job["id"], "error": "memory" if oom else "invalid", "message": text[:2000]})
            return not oom
        send({"id": job["id"], "ok": True})
        return True


def main(argv: list[str]) -> int:
    parent, path, budget, mode = int(argv[1]), json.loads(argv[2]), int(argv[3]), argv[4]
    _die_with_parent(parent)
    sys.path[:] = path
    import resource

    sandbox = _Sandbox(*_import_xgrammar(mode == "lean"))
    _limit(resource.RLIMIT_AS, _vm_bytes() + budget)
    out = sys.stdout

    def send(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    send({"hello": os.getpid()})
    for line in sys.stdin:
        if not sandbox.run(json.loads(line), send):
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
