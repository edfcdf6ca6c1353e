import os

# Tests never reach W&B's servers: offline runs only, and quietly.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
