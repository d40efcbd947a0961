"""The committed SGLang fixture (tests/fixtures/sglang_schema.json) is exactly what the pinned release's own
source says, and t1async's protocol code stays inside it.

The pinned wheel is downloaded with pip into the cache folder (tests/support/sglang_schema.py); the test
skips, saying why, only when the package index cannot be reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support import sglang_schema as schema_tool

ROOT = REPO

FIXTURE = schema_tool.load_fixture()


def _wheel() -> Path:
    try:
        return schema_tool.download(FIXTURE["sglang_version"])
    except schema_tool.SchemaError as e:
        if "Could not find a version" in str(e) or "No matching distribution" in str(e):
            raise  # the index answered: the pinned release is gone, which is a real failure
        pytest.skip(f"package index unreachable, cannot fetch the pinned SGLang wheel: {e}")


def test_fixture_matches_pinned_sglang_source():
    wheel = _wheel()
    fresh = schema_tool.build_schema(wheel, FIXTURE["sglang_version"])
    assert fresh["sha256"] == FIXTURE["sha256"], "the pinned wheel changed on the index"
    for key in ("routes", "classes", "meta_info_keys"):
        assert fresh[key] == FIXTURE[key], f"fixture {key} disagrees with SGLang source; run python tools/sglang_schema.py"


def test_parser_reads_fields_defaults_and_routes_from_source():
    """The ast reader itself, on a small source written here: required vs default fields, field(),
    inherited BaseReq fields, api_route methods, Query parameters, a retired 404 route."""
    io = (
        "from dataclasses import dataclass, field\n"
        "class BaseReq:\n    rid: Optional[str] = field(default=None, kw_only=True)\n"
        "@dataclass\nclass AReq(BaseReq):\n    names: List[str]\n    mode: str = 'abort'\n"
        "    xs: list = field(default_factory=list)\n"
    )
    http = (
        "@app.api_route('/a', methods=['GET', 'POST'])\nasync def a(obj: AReq, request: Request):\n    pass\n"
        "@app.get('/old')\nasync def old():\n    '''doc'''\n    raise HTTPException(status_code=404, detail='gone')\n"
        "@app.post('/f')\nasync def f(timeout: float = Query(0.5, ge=0.0)):\n    pass\n"
        "@app.post('/unused')\nasync def u():\n    pass\n"
    )
    classes = schema_tool.parse_classes(io, ["AReq"])
    assert classes["AReq"]["fields"] == [
        {"name": "rid", "type": "Optional[str]", "default": "None", "required": False},
        {"name": "names", "type": "List[str]", "default": None, "required": True},
        {"name": "mode", "type": "str", "default": "'abort'", "required": False},
        {"name": "xs", "type": "list", "default": "list()", "required": False},
    ]
    routes = schema_tool.parse_routes(http, {"AReq"}, ["/a", "/old", "/f"])
    assert routes == {
        "/a": {"methods": ["GET", "POST"], "function": "a", "body": "AReq", "query": {}, "always_status": None},
        "/f": {"methods": ["POST"], "function": "f", "body": None, "query": {"timeout": "0.5"}, "always_status": None},
        "/old": {"methods": ["GET"], "function": "old", "body": None, "query": {}, "always_status": 404},
    }


def test_weight_sync_bodies_use_only_fields_the_pinned_release_defines():
    """Every field t1async sends to an SGLang server is a field of the release's dataclass, and every
    required field is sent (the fake server enforces the same at run time)."""
    from t1async.weights.buckets import sglang_bodies_example

    for route, body in sglang_bodies_example().items():
        cls = FIXTURE["routes"][route]["body"]
        fields = {f["name"]: f for f in FIXTURE["classes"][cls]["fields"]}
        assert set(body) <= set(fields), (route, set(body) - set(fields))
        assert {n for n, f in fields.items() if f["required"]} <= set(body), route


def test_pinned_release_facts_t1async_relies_on():
    r = FIXTURE["routes"]
    assert r["/get_weight_version"]["always_status"] == 404  # version comes from /model_info and meta_info
    assert r["/flush_cache"]["body"] is None and "POST" in r["/flush_cache"]["methods"]
    mode = {f["name"]: f for f in FIXTURE["classes"]["PauseGenerationReqInput"]["fields"]}["mode"]
    assert "abort" in mode["type"] and "retract" in mode["type"] and "in_place" in mode["type"]
    assert {"weight_version", "routed_experts", "output_token_logprobs", "finish_reason"} <= set(FIXTURE["meta_info_keys"])
    json.dumps(FIXTURE)  # plain JSON, loadable by the fake server


def _sampler_source(wheel: Path) -> str:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        return z.read("sglang/srt/layers/sampler.py").decode("utf-8")


def test_pinned_sampler_reports_the_unrenormalised_tempered_softmax():
    """The facts t1async/models/logprobs.py ``SGLANG`` restates, read from the pinned release's
    ``srt/layers/sampler.py`` (parsed, never run): the reported log-prob is ``log`` of the whole
    tempered softmax the sampler draws from (no renormalisation over top-k / top-p); the torch
    sampler's top-k keeps ranks below k and its top-p cuts where the mass before a token exceeds
    top_p (``>``), both on the cumulative sum of the full distribution (joint, as the flashinfer
    call's ``filter_apply_order="joint"``); ``SGLANG_RETURN_ORIGINAL_LOGPROB`` switches to
    untempered log-probs (launch refuses it, t1async/sampling/sglang_server.py)."""
    import ast

    tree = ast.parse(_sampler_source(_wheel()))
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    sampler = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Sampler")
    forward = next(n for n in sampler.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    stmts = [ast.unparse(n) for n in ast.walk(forward) if isinstance(n, (ast.Assign, ast.Expr))]
    standard = ["logits.div_(sampling_info.temperatures)", "logits[:] = torch.softmax(logits, dim=-1)", "probs = logits"]
    at = [stmts.index(s) for s in standard]
    assert at == sorted(at), "the standard path no longer divides, softmaxes, then keeps probs"
    assert any(s.startswith("logprobs = ") and s.endswith("torch.log(probs)") for s in stmts), \
        "the reported log-prob is no longer log(probs) of the tempered softmax"
    torch_sampler = fns["top_k_top_p_min_p_sampling_from_probs_torch"]
    body = [ast.unparse(n) for n in torch_sampler.body]
    cumsum = body.index("probs_sum = torch.cumsum(probs_sort, dim=-1)")
    top_k = next(i for i, s in enumerate(body) if ">= top_ks.view(-1, 1)" in s)
    assert cumsum < top_k, "top-p no longer reads the full distribution's mass (not joint)"
    cuts = {ast.unparse(c.left): type(c.ops[0]).__name__ for c in ast.walk(torch_sampler) if isinstance(c, ast.Compare)}
    assert cuts.get("probs_sum - probs_sort") == "Gt", cuts
    orders = {ast.unparse(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == "filter_apply_order"}
    assert orders == {"'joint'"}, orders
    env = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "SGLANG_RETURN_ORIGINAL_LOGPROB"]
    assert env, "SGLANG_RETURN_ORIGINAL_LOGPROB renamed: update t1async/sampling/sglang_server.py check_logprob_env"
