"""vLLM's own serving code as an oracle engine (no tests here).

``VllmEngine`` turns a model's true completion ids into the chat.completion vLLM's OpenAI
server returns for them, whole or streamed, by running vLLM's own pieces in the order its
server runs them (vllm 0.34.0, ``entrypoints/openai/chat_completion/serving.py``):

* the parser class ``ParserManager.get_parser`` composes from ``--reasoning-parser`` and
  ``--tool-call-parser`` (``--enable-auto-tool-choice``), instantiated per request with its
  ``chat_template_kwargs``; ``adjust_request`` as the renderer calls it (the Kimi tool
  parser sets ``skip_special_tokens=False`` when tools are sent);
* ``ChatCompletionRequest.to_sampling_params`` and ``update_from_generation_config``: the
  tokenizer's ``eos_token_id`` stops with ``stop_reason`` null, a generation-config end id
  is a ``stop_token_ids`` hit whose id is the ``stop_reason`` (``v1/core/sched/utils.py``
  ``check_stop``);
* ``IncrementalDetokenizer.from_new_request`` primed with the prompt ids, fed one id per
  engine step, the stop id left out of the text (``update(..., stop_terminated)``); a
  whole response reads the text once at the end (``FINAL_ONLY``), a stream one delta per
  step (``DELTA``, ``stream_interval`` 1);
* whole: ``parser.parse`` over the text and ids, ``assemble_chat_message_fields``,
  ``resolve_finish_reason``, ``count_reasoning_tokens``; usage counts every output id,
  the stop id included;
* streamed: ``ChatStreamProcessor.step`` per delta, the chunks built and dumped as the
  server dumps them (``exclude_unset``), then the ``include_usage`` chunk; tokenbridge's
  own ``StreamAssembler`` folds them as generate does;
* gpt-oss (``model_type == "gpt_oss"``): the same steps, but ``get_parser(is_harmony=True)``
  composes ``HarmonyParser`` (``openai_gptoss`` + ``openai``), which reads the output ids
  with ``openai_harmony``'s ``StreamableParser`` (the detokenized text goes unread) and
  joins several messages of a channel with a newline; the prompt is rendered by
  ``openai_harmony`` (tokenbridge's ``gpt-oss-harmony`` dialect), and ``created`` is the
  serving time, as vLLM stamps it (the harmony prompt prints the serving day).

vllm is imported without running ``vllm/__init__.py``: that file runs ``env_override``,
which patches torch (inductor settings, CUDA paths) for every test in the process. The
package is registered as a bare namespace (its real ``__path__``) and the parser, protocol
and detokenizer modules import normally; nothing inside vllm is replaced. They pull in
much of vLLM's runtime at import (config, multimodal, the metrics): requirements-oracles.txt
pins the small packages that needs, all installed ``--no-deps``. No CUDA is touched.

Tokenizers: the ``tokenizer.json`` families load through vLLM's own
``CachedHfTokenizer`` (transformers' fast tokenizer, so vLLM's
``FastIncrementalDetokenizer``). Kimi's folder holds the data but not its remote code
(``tokenization_kimi.py``, see its PROVENANCE.md), so :class:`KimiSlowTokenizer` stands in:
a transformers ``PreTrainedTokenizer`` (the slow class that file defines, hence vLLM's
``SlowIncrementalDetokenizer``) with that file's decode side: each id's vocab string is its
bytes through GPT-2's byte-to-unicode table, ``convert_tokens_to_string`` maps them back;
the added and special tokens come from the folder's ``tokenizer_config.json``, read by
transformers' own constructor. Only decoding is used.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any

from test_families_support import SHARED, _byte_decoder

VLLM_PIN = "0.34.0"


def register_vllm_namespace(missing: Any) -> None:
    """Register vllm as a bare namespace package (see the module doc); ``missing(reason)``
    (pytest.skip or pytest.fail) when it is not installed."""
    if "vllm" in sys.modules:
        return
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        missing("vllm is not installed: `make` installs requirements-oracles.txt (--no-deps)")
        return
    pkg = types.ModuleType("vllm")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["vllm"] = pkg


#: vLLM's logprobs builders, by where they are defined: (module, enclosing class or "").
_LOGPROB_FUNCTIONS = {
    "vllm.entrypoints.openai.chat_completion.serving": (("OpenAIServingChat", "_create_chat_logprobs"),
                                                         ("OpenAIServingChat", "_get_top_logprobs")),
    "vllm.entrypoints.generate.base.serving": (("GenerateBaseServing", "_get_decoded_token"),
                                               ("", "format_token_id_placeholder"), ("", "chat_top_logprobs_limit")),
}


def vllm_source_functions(names: dict[str, tuple[tuple[str, str], ...]], namespace: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own functions, compiled from its installed source files: the modules that
    hold the serving class import ``vllm/__init__`` (``from vllm import RequestOutput``)
    and the whole server stack, so the named definitions are taken from the file as they
    are and run in ``namespace`` (the names they use); annotations are never evaluated."""
    import __future__
    import ast

    out: dict[str, Any] = {}
    for module, wanted in names.items():
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, module
        with open(spec.origin, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), spec.origin)
        found: list[ast.stmt] = []
        for owner, name in wanted:
            scope = tree.body if not owner else next(
                n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner)
            node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
            node.decorator_list = []  # staticmethod: called plainly here
            found.append(node)
        code = compile(ast.Module(body=found, type_ignores=[]), spec.origin, "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, namespace)  # noqa: S102 - vLLM's own code, from its installed files
        out |= {name: namespace[name] for _, name in wanted}
    return out


@dataclass(frozen=True)
class Vllm:
    """The vLLM pieces the engine runs (see the module doc)."""

    ParserManager: Any
    ChatCompletionRequest: Any
    ChatCompletionResponse: Any
    ChatCompletionResponseChoice: Any
    ChatMessage: Any
    ChatCompletionStreamResponse: Any
    ChatCompletionResponseStreamChoice: Any
    DeltaMessage: Any
    UsageInfo: Any
    CompletionTokenUsageInfo: Any
    assemble_chat_message_fields: Any
    ChatStreamProcessor: Any
    resolve_finish_reason: Any
    IncrementalDetokenizer: Any
    get_cached_tokenizer: Any
    CachedHfTokenizer: Any
    version: str


def import_vllm(missing: Any) -> Vllm:
    """vLLM's serving pieces; ``missing(reason)`` when vllm is absent or does not import."""
    register_vllm_namespace(missing)
    try:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion import protocol as chat
        from vllm.entrypoints.openai.chat_completion.message_assembly import assemble_chat_message_fields
        from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor
        from vllm.entrypoints.serve.engine.protocol import CompletionTokenUsageInfo, UsageInfo
        from vllm.entrypoints.serve.utils.tool_calls_utils import resolve_finish_reason
        from vllm.parser import ParserManager
        from vllm.tokenizers.hf import CachedHfTokenizer, get_cached_tokenizer
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer
        from vllm.version import __version__
    except ImportError as e:  # pragma: no cover - CI installs the pins
        missing(f"vllm's serving modules do not import ({e}): install requirements-oracles.txt")
        raise
    return Vllm(ParserManager, chat.ChatCompletionRequest, chat.ChatCompletionResponse,
                chat.ChatCompletionResponseChoice, chat.ChatMessage, chat.ChatCompletionStreamResponse,
                chat.ChatCompletionResponseStreamChoice, DeltaMessage, UsageInfo, CompletionTokenUsageInfo,
                assemble_chat_message_fields, ChatStreamProcessor, resolve_finish_reason, IncrementalDetokenizer,
                get_cached_tokenizer, CachedHfTokenizer, __version__)


def kimi_slow_tokenizer(tb: Any) -> Any:
    """The Kimi K2.5 tokenizer as vLLM loads it (a slow transformers tokenizer; see the
    module doc), decoding with ``tb``'s (tokenbridge's) bytes per id."""
    from transformers import AddedToken, PreTrainedTokenizer

    byte_decoder = _byte_decoder()
    byte_encoder = {b: c for c, b in byte_decoder.items()}

    class KimiSlowTokenizer(PreTrainedTokenizer):
        vocab_files_names = {"vocab_file": "tiktoken.model"}
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, **kwargs: Any) -> None:
            self.n_words = tb.vocab_size
            self.decoder = {i: "".join(byte_encoder[b] for b in tb.token_bytes(i)) for i in range(self.n_words)}
            self.encoder = {s: i for i, s in self.decoder.items()}
            super().__init__(**kwargs)

        @property
        def vocab_size(self) -> int:
            return self.n_words

        def get_vocab(self) -> dict[str, int]:
            return self.encoder

        def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
            return [self.decoder[t] for t in tb.encode(text)]

        def _convert_token_to_id(self, token: str) -> int:
            return self.encoder.get(token, self.unk_token_id)

        def _convert_id_to_token(self, index: int) -> str | None:
            return self.decoder.get(index)

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return bytearray(byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    cfg = json.loads((SHARED / "kimi-k2.5" / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = {int(k): AddedToken(**v) for k, v in cfg["added_tokens_decoder"].items()}
    return KimiSlowTokenizer(added_tokens_decoder=added, additional_special_tokens=cfg["additional_special_tokens"],
                             bos_token=cfg["bos_token"], eos_token=cfg["eos_token"], unk_token=cfg["unk_token"],
                             pad_token=cfg["pad_token"], clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class Family:
    """How a vLLM server for one family is launched: its parsers and its end ids."""

    folder: str
    reasoning_parser: str
    tool_parser: str
    #: the tokenizer's ``eos_token`` (stops with ``stop_reason`` null)
    eos: str
    #: the generation config's other end ids (``stop_token_ids``: ``stop_reason`` is the id)
    stop: tuple[str, ...] = ()
    #: a ``gpt_oss`` model: the server composes ``HarmonyParser``, which parses the ids
    #: with ``openai_harmony`` (the text the detokenizer makes is not read)
    harmony: bool = False
    #: the tokenbridge dialect that renders the prompt as this server does (None: the folder's)
    dialect: str | None = None


#: The parsers each family's model card launches vLLM with. End ids: Kimi K2.5's tokenizer
#: eos is ``[EOS]`` and its model config's eos 163586 ``<|im_end|>``
#: (config.kimi-k2.6-bundle.json), which vLLM's generation config takes; Qwen3's tokenizer
#: eos is ``<|im_end|>``, its generation config adds ``<|endoftext|>``; GLM-4.5's tokenizer
#: eos is ``<|endoftext|>`` (the folder here has no tokenizer_config; the model's does), its
#: generation config adds ``<|user|>`` and ``<|observation|>``; DeepSeek V3.1 ends with
#: its tokenizer eos alone. gpt-oss's tokenizer eos is ``<|return|>``, its generation config
#: adds ``<|endoftext|>`` and ``<|call|>``; vLLM renders its prompt with ``openai_harmony``
#: (tokenbridge's ``gpt-oss-harmony`` dialect).
FAMILIES = {
    "kimi-k2.5": Family("kimi-k2.5", "kimi_k2", "kimi_k2", "[EOS]", ("<|im_end|>",)),
    "qwen3": Family("qwen3", "qwen3", "hermes", "<|im_end|>", ("<|endoftext|>",)),
    "glm-4.5": Family("glm-4.5", "glm45", "glm45", "<|endoftext|>", ("<|user|>", "<|observation|>")),
    "deepseek-v3.1": Family("deepseek-v3.1", "deepseek_v3", "deepseek_v31", "<｜end▁of▁sentence｜>"),
    "gpt-oss": Family("gpt-oss", "openai_gptoss", "openai", "<|return|>", ("<|endoftext|>", "<|call|>"),
                      harmony=True, dialect="gpt-oss-harmony"),
}


@dataclass
class _Req:
    """The fields of an ``EngineCoreRequest`` the detokenizer reads."""

    prompt_token_ids: list[int]
    sampling_params: Any
    request_id: str = "chatcmpl-oracle"
    prompt_embeds: Any = None


@dataclass
class VllmEngine:
    """vLLM's OpenAI server for one family (``serve``; see the module doc)."""

    tb: Any
    family: Family
    v: Vllm
    hf: Any = None
    parser_cls: Any = None
    eos_id: int = 0
    stop_ids: list[int] = field(default_factory=list)
    #: vLLM's ``_create_chat_logprobs`` and what it calls (:func:`vllm_source_functions`)
    chat_logprobs: Any = None

    def __post_init__(self) -> None:
        if self.family.harmony:  # openai_harmony's o200k_base, offline (the folder's file is OpenAI's)
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(SHARED / self.family.folder)
        base = kimi_slow_tokenizer(self.tb) if self.family.folder == "kimi-k2.5" else \
            self.v.CachedHfTokenizer.from_pretrained(str(SHARED / self.family.folder))
        self.hf = self.v.get_cached_tokenizer(base)
        self.parser_cls = self.v.ParserManager.get_parser(
            tool_parser_name=self.family.tool_parser, reasoning_parser_name=self.family.reasoning_parser,
            enable_auto_tools=True, model_name=self.family.folder, is_harmony=self.family.harmony, tokenizer=self.hf)
        self.eos_id = self.tb.token_id(self.family.eos)
        self.stop_ids = [self.tb.token_id(s) for s in self.family.stop]
        from vllm.entrypoints.openai.chat_completion import protocol as chat

        names = {n: getattr(chat, n) for n in ("ChatCompletionLogProb", "ChatCompletionLogProbs",
                                                "ChatCompletionLogProbsContent")}
        self.chat_logprobs = vllm_source_functions(_LOGPROB_FUNCTIONS, {"itertools": itertools, **names})

    def _logprobs_processor(self) -> Any:
        """vLLM's per-request ``LogprobsProcessor`` (``v1/engine/logprobs.py``): each sampled
        id's ``decoded_token``, the text before it taken into account where the id alone is
        part of a character (``_verify_tokens``)."""
        from vllm.logprobs import create_sample_logprobs
        from vllm.v1.engine.logprobs import LogprobsProcessor

        return LogprobsProcessor(tokenizer=self.hf, logprobs=create_sample_logprobs(False), prompt_logprobs=None,
                                 cumulative_logprob=0.0, num_logprobs=0, num_prompt_logprobs=None)

    def _logprobs(self, req: Any, proc: Any, ids: list[int]) -> Any:
        """``choices[].logprobs`` for ``ids`` (one engine step each, ``proc`` holding the
        earlier ones), as the server's ``_create_chat_logprobs`` builds it; None without
        ``logprobs`` in the request."""
        import numpy as np

        if not req.logprobs:
            return None
        start = len(proc.logprobs)
        for i in ids:  # the sampled id with its logprob and rank, as the engine core sends it
            proc._update_sample_logprobs(([np.array([i])], [np.array([-0.25])], [np.array([1])], None))
        f = self.chat_logprobs

        class Serving:  # the serving instance's attributes the method reads
            return_tokens_as_token_ids = False
            _get_decoded_token = staticmethod(f["_get_decoded_token"])
            _get_top_logprobs = f["_get_top_logprobs"]

        return f["_create_chat_logprobs"](Serving(), ids, proc.logprobs[start:], self.hf,
                                          num_output_top_logprobs=req.top_logprobs,
                                          logprob_token_ids=req.logprob_token_ids,
                                          return_as_token_id=req.return_tokens_as_token_ids)

    def _parser(self, req: Any, prompt: list[int]) -> Any:
        parser = self.parser_cls(self.hf, req.tools, chat_template_kwargs=req.chat_template_kwargs or {},
                                 model_config=None)
        parser.set_prompt_token_ids(prompt)
        return parser

    def serve(self, body: dict[str, Any], prompt: list[int], ids: list[int], *, stream: bool) -> dict[str, Any]:
        """The chat.completion vLLM returns for completion ``ids`` (ending in a stop id, or
        cut: ``finish_reason: length``) after ``prompt``; streamed: the chunks folded by
        tokenbridge's ``StreamAssembler``."""
        req = self.v.ChatCompletionRequest(**body)
        req = self._parser(req, prompt).adjust_request(req)  # the renderer's call
        params = req.to_sampling_params(1 << 20, {})
        params.update_from_generation_config({"eos_token_id": self.stop_ids}, self.eos_id)
        ends = {params.eos_token_id, *(params.stop_token_ids or ())}
        assert all(i not in ends for i in ids[:-1]), "a stop id before the last id: the engine stops there"
        finish = "stop" if ids and ids[-1] in ends else "length"
        stop_reason = ids[-1] if finish == "stop" and ids[-1] != params.eos_token_id else None
        detok = self.v.IncrementalDetokenizer.from_new_request(self.hf, _Req(list(prompt), params))
        if stream:
            return self._stream(req, prompt, ids, detok, finish, stop_reason)
        return self._whole(req, prompt, ids, detok, finish, stop_reason)

    def _whole(self, req: Any, prompt: list[int], ids: list[int], detok: Any, finish: str,
               stop_reason: int | None) -> dict[str, Any]:
        v = self.v
        for k, i in enumerate(ids):  # one id per engine step
            detok.update([i], finish == "stop" and k == len(ids) - 1)
        text = detok.get_next_output_text(True, False)
        parser = self._parser(req, prompt)
        reasoning, content, calls = parser.parse(text, req, enable_auto_tools=True, model_output_token_ids=ids)
        fields = v.assemble_chat_message_fields(req, reasoning, content, calls, enable_auto_tools=True,
                                                parser_cls=self.parser_cls)
        message = v.ChatMessage(role="assistant", reasoning=fields.reasoning, content=fields.content,
                                tool_calls=fields.tool_calls)
        choice = v.ChatCompletionResponseChoice(
            index=0, message=message, finish_reason=v.resolve_finish_reason(finish, req, bool(message.tool_calls)),
            stop_reason=stop_reason, logprobs=self._logprobs(req, self._logprobs_processor(), ids))
        usage = v.UsageInfo(prompt_tokens=len(prompt), completion_tokens=len(ids),
                            total_tokens=len(prompt) + len(ids),
                            completion_tokens_details=v.CompletionTokenUsageInfo(
                                reasoning_tokens=parser.count_reasoning_tokens(ids)))
        response = v.ChatCompletionResponse(id="chatcmpl-oracle", created=int(time.time()), model=req.model,
                                            choices=[choice],
                                            usage=usage)
        return json.loads(json.dumps(response.model_dump()))

    def _stream(self, req: Any, prompt: list[int], ids: list[int], detok: Any, finish: str,
                stop_reason: int | None) -> dict[str, Any]:
        from tokenbridge.generate.sse import StreamAssembler

        v = self.v
        chunks: list[Any] = []
        created = int(time.time())

        def chunk(choice: Any) -> None:
            chunks.append(v.ChatCompletionStreamResponse(id="chatcmpl-oracle", created=created, model=req.model,
                                                         choices=[choice]))

        chunk(v.ChatCompletionResponseStreamChoice(index=0, delta=v.DeltaMessage(role="assistant", content=""),
                                                   logprobs=None, finish_reason=None))
        proc = v.ChatStreamProcessor(req, self._parser(req, prompt), enable_auto_tools=True,
                                     parser_cls=self.parser_cls)
        logged = self._logprobs_processor()
        for k, i in enumerate(ids):
            done = finish if k == len(ids) - 1 else None
            logprobs = self._logprobs(req, logged, [i])
            detok.update([i], done == "stop")
            delta_text = detok.get_next_output_text(done is not None, True)
            if proc.hide_metadata:
                logprobs = None
            delta, reason = proc.step(delta_text, [i], done, prompt)
            if delta is None:
                if done is None and logprobs is None:  # a chunk still goes out for its logprobs
                    continue
                delta = v.DeltaMessage()
            if done is None:
                chunk(v.ChatCompletionResponseStreamChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=None))
            else:
                chunk(v.ChatCompletionResponseStreamChoice(index=0, delta=delta, logprobs=logprobs,
                                                           finish_reason=reason, stop_reason=stop_reason))
        reasoning_tokens = proc.parser.count_reasoning_tokens(tuple(ids))
        usage = v.UsageInfo(prompt_tokens=len(prompt), completion_tokens=proc.num_output_tokens,
                            total_tokens=len(prompt) + proc.num_output_tokens,
                            completion_tokens_details=v.CompletionTokenUsageInfo(reasoning_tokens=reasoning_tokens))
        chunks.append(v.ChatCompletionStreamResponse(id="chatcmpl-oracle", created=created, model=req.model, choices=[],
                                                     usage=usage))
        assembler = StreamAssembler()
        for c in chunks:
            assembler.add(json.loads(c.model_dump_json(exclude_unset=True, exclude_none=not c.choices)))
        return assembler.result()
