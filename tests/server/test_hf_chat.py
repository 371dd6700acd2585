"""The server over a model directory holding a Hugging Face BPE tokenizer and a Jinja chat
template: the prompt it sends the engine is transformers' ``apply_chat_template`` ids, and the
template's ``eos_token`` stops generation."""

from __future__ import annotations

from pathlib import Path

import openai
from transformers import AutoTokenizer

from replaykv.server.settings import ServerSettings
from tests.server.conftest import LiveServer
from tests.server.fake_engine import FakeEngine
from tests.test_tokenizer import CONVERSATION, _as_dicts, _hf_chat_ids, _train_bpe


def test_chat_prompt_is_the_jinja_template_of_the_model_directory(tmp_path: Path) -> None:
    _train_bpe(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    engine = FakeEngine(max_context=1024, vocab_size=len(hf))
    with LiveServer(engine, ServerSettings(model_dir=str(tmp_path))) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model=engine.model_name, messages=_as_dicts(CONVERSATION), max_tokens=4  # type: ignore[arg-type]
        )
    assert r.usage is not None and r.usage.prompt_tokens == len(_hf_chat_ids(hf, CONVERSATION))
    sent = engine.requests[-1]
    assert list(sent.prompt_ids) == _hf_chat_ids(hf, CONVERSATION)
    assert hf.convert_tokens_to_ids("<|im_end|>") in sent.sampling.stop_token_ids
