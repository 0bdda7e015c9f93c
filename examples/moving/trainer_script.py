"""A transformers Trainer script, unchanged: the Trainer reads torchrun's variables, so
`multigpu run -n 2 trainer_script.py` starts it. A tiny Llama from a config (no download)."""
import tempfile

import torch
import transformers
from torch.utils.data import Dataset


class Tokens(Dataset):
    def __init__(self, n: int = 256, seq: int = 32, vocab: int = 256) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = transformers.LlamaForCausalLM(config)
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=20,
                                      learning_rate=1e-3, logging_steps=10, save_strategy="no", report_to=[],
                                      use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0)
result = transformers.Trainer(model=model, args=args, train_dataset=Tokens()).train()
if args.process_index == 0:
    print(f"final train loss {result.training_loss:.6f} over {result.global_step} steps")
