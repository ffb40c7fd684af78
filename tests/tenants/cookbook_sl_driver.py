"""tinker-cookbook's supervised training loop (`tinker_cookbook.supervised.train.main`, what its
`sl_basic` recipe runs) on the cookbook's own example conversations, against a Tinker service.

Run in a subprocess with the cookbook on PYTHONPATH: `python -m tests.tenants.cookbook_sl_driver
BASE_URL MODEL_DIR LOG_PATH`. `sl_basic` itself cannot be pointed at a local model directory (it
looks the name up in the cookbook's table of hosted models to pick a renderer), so this builds the
same `train.Config` with the renderer named.
"""

import asyncio
import sys
from pathlib import Path

import tinker_cookbook
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


def main(base_url: str, model_dir: str, log_path: str) -> None:
    examples = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model_dir, renderer_name="role_colon",
                                            max_length=256, batch_size=32,
                                            train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = train.Config(log_path=log_path, model_name=model_dir, recipe_name="recipe_sl_basic",
                          renderer_name="role_colon", base_url=base_url, lora_rank=8, learning_rate=1e-3,
                          dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(examples)),
                          num_epochs=1, eval_every=0, save_every=0)
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main(*sys.argv[1:4])
