"""`load_hf_checkpoint`: a Hugging Face checkpoint folder (config.json, safetensors shards,
tokenizer.json, tokenizer_config.json) read without transformers equals `GPT.from_hf` of the
same model; the chat template renders as transformers renders it, in `chat` and the server."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

import minifer as mf
from minifer import GPT, SamplingParams, generate, load_hf_checkpoint
from minifer.chat_template import chat_prompt, render_template
from minifer.pretrained import model_files

transformers = pytest.importorskip("transformers")
from test_families import hf_model  # noqa: E402  (after the importorskip)

# A ChatML template in the style of Qwen's: a default system turn, loop controls, tojson and
# raise_exception, the generation prompt.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3's shape: the BOS token's text first, headers, whitespace control.
LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
MESSAGES = [{"role": "user", "content": "Who art thou?  "},
            {"role": "assistant", "content": "A friend — «ami»."},
            {"role": "user", "content": "Speak again."}]


def write_checkpoint(folder, family="qwen2", *, template=CHATML, shard=False):
    """A Hugging Face checkpoint folder of a tiny random model, with the shipped BPE tokenizer
    (2048 tokens) as its tokenizer.json."""
    hf = hf_model(family, vocab_size=2048, eos_token_id=2047, max_position_embeddings=256)
    kw = dict(max_shard_size="200KB") if shard else {}
    hf.save_pretrained(folder, safe_serialization=True, **kw)
    shutil.copy(model_files("shakespeare")[2], folder / "tokenizer.json")
    config = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return hf


@pytest.mark.parametrize("family, shard", [("qwen2", False), ("llama", True), ("qwen3", False)])
def test_folder_equals_from_hf(tmp_path, family, shard):
    hf = write_checkpoint(tmp_path, family, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard
    model, tok = load_hf_checkpoint(tmp_path)
    ref = GPT.from_hf(hf)
    assert model.config == ref.config
    ids = torch.randint(0, 2048, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(model(ids), ref(ids))
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-5
    assert tok.vocab_size == 2048 and tok.eos_token_id == 2047
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    assert generate(model, ["ROMEO:"], params, tok)[0].token_ids == \
        generate(ref, ["ROMEO:"], params, tok)[0].token_ids


def test_folder_dtype_and_gpt2(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=2048, n_positions=64, eos_token_id=2047))
    hf.eval().save_pretrained(tmp_path, safe_serialization=True)
    shutil.copy(model_files("shakespeare")[2], tmp_path / "tokenizer.json")
    model, tok = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert model.transformer.wte.weight.dtype == torch.bfloat16 and tok.chat_template is None
    ids = torch.randint(0, 2048, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert (model.float()(ids) - hf(ids).logits).abs().max().item() < 0.1


def test_missing_or_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="never loaded"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path / "nowhere")


@pytest.mark.parametrize("template", [CHATML, LLAMA3])
def test_template_renders_as_transformers(tmp_path, template):
    write_checkpoint(tmp_path, template=template)
    _, tok = load_hf_checkpoint(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for add in (True, False):
        ref = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        ours = render_template(tok.chat_template, MESSAGES, add_generation_prompt=add,
                               **tok.special_tokens_text)
        assert ours == ref
    assert chat_prompt(MESSAGES, tok) == (
        hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True), [])


def test_template_errors_raise():
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="unknown role"):
        render_template(CHATML, [{"role": "tool", "content": "x"}])


def test_chat_helper_uses_the_template_or_the_play(tmp_path):
    write_checkpoint(tmp_path)
    model, tok = load_hf_checkpoint(tmp_path)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    reply = mf.chat(model, tok, MESSAGES, params)
    prompt, _ = chat_prompt(MESSAGES, tok)
    [ref] = generate(model, [tok.encode(prompt, special_tokens=True)], params, tok)
    assert reply.token_ids == ref.token_ids and len(reply.token_ids) == 6
    # the shipped tokenizer alone has no template: the play form, ending at a blank line
    play, stops = chat_prompt(MESSAGES, mf.Tokenizer.from_file(model_files("shakespeare")[2]))
    assert play.endswith("JULIET:\n") and stops == ["\n\n"]


def test_server_chat_uses_the_checkpoint_template(tmp_path):
    pytest.importorskip("fastapi")
    from minifer.serve.protocol import Limits, parse_chat_request

    write_checkpoint(tmp_path)
    _, tok = load_hf_checkpoint(tmp_path)
    req = parse_chat_request({"model": "m", "messages": MESSAGES, "max_tokens": 4},
                             model_name="m", limits=Limits(max_model_len=128, max_tokens=16),
                             tokenizer=tok, vocab_size=2048)
    prompt, _ = chat_prompt(MESSAGES, tok)
    assert req.prompt_ids == tok.encode(prompt, special_tokens=True)
    assert "\n\n" not in req.params.stop  # the reply ends at the model's end of turn (EOS)


def test_http_server_chats_with_the_checkpoint_template(tmp_path):
    """`python -m minifer.serve --model <folder>` loads the folder; the server's chat answer is
    `chat` of the same messages (the checkpoint's template, ended at its EOS)."""
    openai = pytest.importorskip("openai")
    from minifer.serve.__main__ import load_model
    from minifer_course.server import running_server

    write_checkpoint(tmp_path)
    model, tok = load_model(str(tmp_path))
    assert tok.chat_template == CHATML
    ref = mf.chat(model, tok, MESSAGES, SamplingParams(temperature=0, max_new_tokens=12))
    with running_server(model, tok, model_name="qwen-tiny", max_num_seqs=2) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="qwen-tiny", messages=MESSAGES, max_tokens=12,
                                      temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == ref.completion_tokens


def test_a_damaged_shard_is_a_clear_error(tmp_path):
    write_checkpoint(tmp_path, "llama", shard=True)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"corrupt checkpoint weights .*{shard.name}"):
        load_hf_checkpoint(tmp_path)


def _llama_style_tokenizer(folder, bos: str = "<|endoftext|>"):
    """The shipped tokenizer with a post-processor that starts every text with `bos`, as a Llama
    checkpoint's tokenizer.json does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    bos_id = hf.token_to_id(bos)
    hf.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                           special_tokens=[(bos, bos_id)])
    hf.save(str(folder / "tokenizer.json"))
    return bos_id


def test_a_llama_checkpoints_bos_starts_plain_prompts_not_chats(tmp_path):
    """A plain prompt gets the BOS that transformers' ``tokenizer(text)`` adds; a chat template
    writes its own, so a chat does not get a second one."""
    from minifer.tokenizer import encode_prompt

    write_checkpoint(tmp_path, "llama", template=LLAMA3)
    bos = _llama_style_tokenizer(tmp_path)
    model, tok = load_hf_checkpoint(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.bos_token_id == bos
    for text in ("ROMEO:", "What light through yonder window breaks?"):
        assert encode_prompt(tok, text) == hf_tok(text).input_ids
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    [done] = generate(model, ["ROMEO:"], params, tok)
    assert done.prompt_token_ids == hf_tok("ROMEO:").input_ids  # BOS first
    prompt, _ = chat_prompt(MESSAGES, tok)
    chat_ids = tok.encode(prompt, special_tokens=True)
    assert chat_ids == hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]
    assert chat_ids[:2] != [bos, bos]
    if importlib.util.find_spec("fastapi") is not None:  # the server encodes as transformers does
        from minifer.serve.protocol import Limits, parse_chat_request, parse_completion_request

        options = dict(model_name="m", limits=Limits(max_model_len=256, max_tokens=16),
                       tokenizer=tok, vocab_size=2048)
        plain = parse_completion_request({"model": "m", "prompt": "ROMEO:", "max_tokens": 2}, **options)
        chat = parse_chat_request({"model": "m", "messages": MESSAGES, "max_tokens": 2}, **options)
        assert plain.prompt_ids == hf_tok("ROMEO:").input_ids and chat.prompt_ids == chat_ids
    # without the post-processor's BOS, or with add_bos_token false, a prompt starts as written
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "add_bos_token": False}))
    assert load_hf_checkpoint(tmp_path)[1].bos_token_id is None
    qwen = tmp_path / "qwen"  # Qwen's tokenizer adds nothing
    qwen.mkdir()
    write_checkpoint(qwen, "qwen2")
    assert load_hf_checkpoint(qwen)[1].bos_token_id is None


def test_every_eos_id_of_the_checkpoint_ends_a_reply(tmp_path):
    """Llama 3.1's instruct models list several EOS ids (config.json, generation_config.json):
    a reply ends at whichever comes first, as transformers' generate does."""
    hf = write_checkpoint(tmp_path, "llama")
    model, tok = load_hf_checkpoint(tmp_path)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    [free] = generate(model, ["ROMEO:"], params, tok)
    stop = free.token_ids[2]  # a token the model writes: made an end-of-sequence id below
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2047, stop]}))
    model, tok = load_hf_checkpoint(tmp_path)
    assert tok.eos_token_id == 2047 and tok.more_eos_token_ids == ({stop} - {2047})
    [done] = generate(model, ["ROMEO:"], SamplingParams(temperature=0, max_new_tokens=12), tok)
    end = min(i for i, t in enumerate(free.token_ids) if t in (2047, stop))
    assert done.finish_reason == "eos" and done.token_ids == free.token_ids[:end + 1]
    out = hf.generate(torch.tensor([done.prompt_token_ids]), max_new_tokens=12, do_sample=False,
                      eos_token_id=[2047, stop], pad_token_id=2047)
    assert out[0, len(done.prompt_token_ids):].tolist() == done.token_ids
