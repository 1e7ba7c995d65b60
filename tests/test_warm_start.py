import pytest
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.harness.demos import demonstration
from gyre.model.tokenizer import Tokenizer
from gyre.tasks.suite import sample_tasks
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.warm_start import encode_conversation, pack_batch

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(["hello world, create files and finish", '{"name": "write_file"}'], 300)


def test_conversation_mask_covers_exactly_the_assistant_replies(tokenizer):
    task = sample_tasks(["write_value"], 1, seed=3)[0]
    messages, tools = demonstration(task)
    ids, mask = encode_conversation(messages, tools, tokenizer)
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained.count("<|im_end|>") == 2  # the write_file reply and the finish reply
    assert '"name": "write_file"' in trained and "system" not in trained and task.prompt not in trained


def test_packed_rows_compute_what_each_conversation_computes_alone():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64)  # fmt: skip
    trainer = MegatronTrainer(cfg, TrainConfig(num_threads=1))
    examples = [(torch.randint(1, 64, (n,)).tolist(), [0] * (n // 2) + [1] * (n - n // 2)) for n in (9, 5, 7)]
    batch = pack_batch(examples, row_tokens=16, pad_id=0)
    assert batch.tokens.shape[0] == 2  # 9 + 7 in one row, 5 in another
    with torch.no_grad():
        packed = trainer.token_logprobs(batch.tokens, batch.attention_mask)
        for ids, mask in examples:
            alone = trainer.token_logprobs(torch.tensor([ids]))[0]
            row, start = _locate(batch.tokens, ids)
            assert torch.allclose(packed[row, start : start + len(ids) - 1], alone, atol=1e-5)
            assert batch.loss_mask[row, start : start + len(ids) - 1].tolist() == [float(m) for m in mask[1:]]


def _locate(tokens, ids):
    n = len(ids)
    for r in range(tokens.shape[0]):
        for s in range(tokens.shape[1] - n + 1):
            if tokens[r, s : s + n].tolist() == ids:
                return r, s
    raise AssertionError("conversation not found in the packed batch")
