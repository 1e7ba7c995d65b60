"""Load SGLang's real request definitions (sglang/srt/managers/io_struct.py) on a CPU machine.

`pip install --no-deps sglang` gives SGLang's source, but `import sglang` runs package __init__
files that pull triton (about 1 GB), CUDA kernels, IPython and the multimodal stack. The request
structs themselves only need msgspec, pydantic, numpy and torch. So this loader:

- registers the packages `sglang`, `sglang.srt`, ... as plain modules whose `__path__` is the
  installed source directory, so their submodules load from SGLang's own files but the package
  __init__ side effects do not run;
- imports io_struct.py itself and the light modules it needs (msgspec_utils, field_validators,
  weight_versions, sampling_params, kv_hints, sampling_mask, beam_search types, environ,
  lora_registry, embed_types, msgpack_utils) from SGLang's files, unchanged;
- stands in only for names from the heavy modules (schedule_batch, multimodal utilities, CUDA IPC
  transport, the utils package namespace). Each stand-in is `typing.Any` or a small placeholder, and
  none is a request class or the type of a field our client sends; `STUBBED` lists them.

The request classes come from SGLang's source, unchanged; the tests parse payloads the way SGLang's
FastAPI server does (pydantic over those classes) and, more strictly, reject keys a class lacks.
"""

from __future__ import annotations

import argparse
import ast
import base64
import binascii
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import io
import json
import pickle
import re
import sys
import types
from decimal import Decimal
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Optional

# Names taken from heavy SGLang modules, replaced here. None is a request class or a field we send.
STUBBED: dict[str, dict[str, Any]] = {
    "sglang.srt.managers.schedule_batch": {
        "Modality": Any,
        "MultimodalProcessorOutput": Any,
        "ReturnHiddenStatesMode": Any,
        "SamplingLogprobsMode": Any,
        "get_return_hidden_states_mode": None,  # called only when return_hidden_states is set
    },
    "sglang.srt.multimodal.mm_utils": {"has_valid_data": lambda data: data is not None and data != []},
    "sglang.srt.utils.cuda_ipc_transport_utils": {"CudaIpcTensorTransportProxy": type("CudaIpcProxyStub", (), {})},
    "sglang.srt.utils.aio_rwlock": {"RWLock": type("RWLockStub", (), {})},
}
# Attributes of the sglang.srt.utils package (its __init__ imports the CUDA stack) that modules use.
UTILS_NAMES: dict[str, Any] = {
    "ImageData": Any,
    "VideoData": Any,
    "ConcurrentCounter": type("ConcurrentCounterStub", (), {}),
    "flatten_nested_list": None,
}
_PACKAGES = (
    "sglang",
    "sglang.srt",
    "sglang.srt.managers",
    "sglang.srt.utils",
    "sglang.srt.sampling",
    "sglang.srt.sampling.watermarking",
    "sglang.srt.lora",
    "sglang.srt.multimodal",
    "sglang.srt.beam_search",
    "sglang.srt.entrypoints",
    "sglang.srt.arg_groups",
    "sglang.srt.arg_groups.fields",
    "sglang.srt.model_executor",
)
# Top-level definitions taken from sglang/srt/utils/common.py's own source for the argument fields
# (the module as a whole imports triton). Its json_list_type calls orjson; json stands in if absent.
# The weight-update halves come from there too: the deserializer of /update_weights_from_tensor payloads
# and the engine side of the /init_weights_update_group rendezvous. pybase64 is the base64 API in C;
# the standard library's base64 stands in (same functions, same results).
COMMON_NAMES = (
    "nullable_str",
    "human_readable_int",
    "json_list_type",
    "SUPPORTED_LORA_TARGET_MODULES",
    "LORA_TARGET_ALL_MODULES",
    "MultiprocessingSerializer",
    "SafeUnpickler",
    "_safe_load_torch_storage",
    "init_custom_process_group",
)


class SGLangNotInstalled(RuntimeError):
    pass


def sglang_root() -> Path:
    light = sys.modules.get("sglang")
    if light is not None and getattr(light, "__gyre_light__", False):
        return Path(light.__path__[0])
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.submodule_search_locations is None:
        raise SGLangNotInstalled(
            "sglang is not installed; run tools/setup_env.sh (it does `pip install --no-deps sglang==...`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def _register_packages(root: Path) -> None:
    for name in _PACKAGES:
        if name in sys.modules and getattr(sys.modules[name], "__gyre_light__", False):
            continue
        mod = types.ModuleType(name)
        mod.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__spec__.submodule_search_locations = mod.__path__
        mod.__gyre_light__ = True
        sys.modules[name] = mod
    utils = sys.modules["sglang.srt.utils"]
    for attr, value in UTILS_NAMES.items():
        setattr(utils, attr, value)
    for name, attrs in STUBBED.items():
        mod = types.ModuleType(name)
        for attr, value in attrs.items():
            setattr(mod, attr, value)
        sys.modules[name] = mod


def load_io_struct() -> types.ModuleType:
    """SGLang's sglang.srt.managers.io_struct module, executed from its own source file."""
    existing = sys.modules.get("sglang.srt.managers.io_struct")
    if existing is not None:
        return existing
    if "sglang" in sys.modules and not getattr(sys.modules["sglang"], "__gyre_light__", False):
        return importlib.import_module("sglang.srt.managers.io_struct")  # the real package is importable here
    _register_packages(sglang_root())
    return importlib.import_module("sglang.srt.managers.io_struct")


def _light_common(root: Path) -> types.ModuleType:
    """sglang.srt.utils.common holding only COMMON_NAMES, each executed from SGLang's own source."""
    path = root / "srt" / "utils" / "common.py"
    tree = ast.parse(path.read_text(), str(path))
    mod = types.ModuleType("sglang.srt.utils.common")
    mod.__file__ = str(path)
    try:
        import orjson
    except ImportError:
        orjson = json
    import torch

    mod.__dict__.update(argparse=argparse, json=json, re=re, Decimal=Decimal, orjson=orjson, io=io, pickle=pickle)
    mod.__dict__.update(torch=torch, pybase64=base64, binascii=binascii, ForkingPickler=ForkingPickler)
    mod.__dict__["torch_release"] = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    found = set()
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else []
        if isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        if set(names) & set(COMMON_NAMES):
            exec(compile(ast.Module([node], []), str(path), "exec"), mod.__dict__)
            found.update(names)
    missing = set(COMMON_NAMES) - found
    if missing:
        raise RuntimeError(f"sglang {sglang_version()}: {sorted(missing)} no longer in {path}; update COMMON_NAMES")
    return mod


def _input_namespaces(root: Path) -> list[str]:
    """The class names in server_args.py's `_INPUT_NAMESPACES = [...]`: what ServerArgs is built from."""
    path = root / "srt" / "server_args.py"
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_INPUT_NAMESPACES" for t in node.targets):
            return [elt.id for elt in node.value.elts]
    raise RuntimeError(f"sglang {sglang_version()}: no _INPUT_NAMESPACES in {path}; the loader needs updating")


def server_args_parser() -> argparse.ArgumentParser:
    """An argparse parser with every ServerArgs flag SGLang declares in sglang/srt/arg_groups/fields/.

    Built by SGLang's own `add_cli_args_from_dataclass` over the namespace structs that
    server_args.py assembles into ServerArgs (its `_INPUT_NAMESPACES`). server_args.py itself is not
    imported (it pulls triton via utils.common); the flags it registers by hand (--sampling-backend,
    --reasoning-parser, --tool-call-parser, --kv-canary-real-data, --config, deprecated spellings) are
    not in this parser, and our command lines use none of them.
    """
    light_common()
    root = sglang_root()
    arg_utils = importlib.import_module("sglang.srt.arg_groups.arg_utils")
    classes: dict[str, type] = {}
    for path in sorted((root / "srt" / "arg_groups" / "fields").glob("*.py")):
        if path.stem == "__init__":
            continue
        mod = importlib.import_module(f"sglang.srt.arg_groups.fields.{path.stem}")
        classes |= {k: v for k, v in vars(mod).items() if isinstance(v, type) and hasattr(v, "_NS_PATH")}
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    for name in _input_namespaces(root):
        arg_utils.add_cli_args_from_dataclass(parser, classes[name])
    return parser


def parse_server_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """`argv` as `prepare_server_args` (sglang/srt/server_args.py) reads it: a `--config` YAML file merged in
    by SGLang's own ConfigArgumentMerger (loaded from its source: the package's __init__ needs its runtime)."""
    parser = server_args_parser()
    parser.add_argument("--config", help="the flag server_args.py adds by hand")
    path = sglang_root() / "srt" / "utils" / "server_args_config_parser.py"
    spec = importlib.util.spec_from_file_location("sglang_server_args_config_parser", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if "--config" in argv:
        argv = module.ConfigArgumentMerger(parser).merge_config_with_args(argv)
    return parser.parse_known_args(argv)


def light_common() -> types.ModuleType:
    """The COMMON_NAMES of sglang.srt.utils.common, from SGLang's source."""
    load_io_struct()
    existing = sys.modules.get("sglang.srt.utils.common")
    if existing is None or not hasattr(existing, "MultiprocessingSerializer"):
        sys.modules["sglang.srt.utils.common"] = _light_common(sglang_root())
    return sys.modules["sglang.srt.utils.common"]


def load_sampling_params() -> type:
    load_io_struct()
    return importlib.import_module("sglang.srt.sampling.sampling_params").SamplingParams


# endpoint -> SGLang request class its FastAPI handler parses the body into (http_server.py)
ENDPOINT_CLASS = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}


def _fields(cls: type) -> tuple[set[str], set[str]]:
    """(all field names, required field names) of a msgspec Struct or a dataclass."""
    import msgspec

    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        fields = msgspec.structs.fields(cls)
        required = {f.name for f in fields if f.required}
        return {f.name for f in fields}, required
    fields = dataclasses.fields(cls)
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return {f.name for f in fields}, required


def sglang_routes() -> dict[str, set[str]]:
    """path -> HTTP methods of every route SGLang's server declares (sglang/srt/entrypoints/http_server.py's
    @app.get/post/put/api_route decorators, read from its source: the module imports the CUDA stack)."""
    tree = ast.parse((sglang_root() / "srt" / "entrypoints" / "http_server.py").read_text())
    routes: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.args):
                continue
            if not (isinstance(deco.func.value, ast.Name) and deco.func.value.id == "app"):
                continue
            if not isinstance(deco.args[0], ast.Constant):  # a path held in a variable: not a route Gyre calls
                continue
            path = ast.literal_eval(deco.args[0])
            if deco.func.attr == "api_route":
                methods = next(ast.literal_eval(k.value) for k in deco.keywords if k.arg == "methods")
            else:
                methods = [deco.func.attr.upper()]
            routes.setdefault(path, set()).update(methods)
    return routes


def parse_like_sglang(path: str, payload: dict) -> object:
    """Parse a request body as SGLang's server does, after checking its keys exactly."""
    from pydantic import TypeAdapter

    cls = getattr(load_io_struct(), ENDPOINT_CLASS[path])
    names, required = _fields(cls)
    unknown = sorted(set(payload) - names)
    assert not unknown, f"{path}: {unknown} are not fields of SGLang's {cls.__name__} (SGLang would drop them)"
    missing = sorted(required - set(payload) - {"rid", "http_worker_ipc"})
    assert not missing, f"{path}: required fields {missing} of {cls.__name__} are missing"
    return TypeAdapter(cls).validate_json(json.dumps(payload))


def load_sampler_function(name: str) -> Any:
    """A module-level function of SGLang's sglang/srt/layers/sampler.py, compiled from its own source alone.

    The module imports the CUDA sampling stack (flashinfer, distributed groups), so it is not imported; the
    function's source is cut out (decorators such as torch.compile dropped) and run with torch only."""
    path = sglang_root() / "srt" / "layers" / "sampler.py"
    tree = ast.parse(path.read_text())
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        raise LookupError(f"{path} has no function {name}; SGLang changed, re-read its sampler")
    node.decorator_list = []
    import torch

    namespace: dict[str, Any] = {"torch": torch, "Optional": Optional}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace[name]


def load_auth() -> types.ModuleType:
    """sglang/srt/utils/auth.py (SGLang's per-route auth decision; it imports nothing heavy), from its own file."""
    path = sglang_root() / "srt" / "utils" / "auth.py"
    spec = importlib.util.spec_from_file_location("gyre_sglang_auth", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod
