"""ddplab's one entrypoint: compose the config, start the process group, train, tear down.

    torchrun --nproc_per_node=2 train.py                       # mlp on synthetic data, sync=ddp, W&B offline
    torchrun --nproc_per_node=2 train.py sync=manual           # all_reduce(SUM) / world_size after backward
    torchrun --nproc_per_node=2 train.py sync=ddp sync.bucket_cap_mb=5
    torchrun --nproc_per_node=2 train.py sync=none             # no communication: a divergence baseline
    python train.py                                            # one process, world size 1, same code path
    torchrun --nproc_per_node=2 train.py -m sync.bucket_cap_mb=1,5,25      # a sweep, every rank in step
    python train.py -m hydra/launcher=torchrun sync.bucket_cap_mb=1,5,25   # each job its own torchrun group

Every rank runs this file. Before Hydra composes anything, rank 0 picks the run's name and the
others receive it through torchrun's store, so all ranks write into one run directory.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from trainer.reliability.exits import ctrl_c_held, exit_cleanly, stopped_by_ctrl_c
from trainer.setup.torch_version import refuse_old_torch

# Ctrl-C while a rank starts up or shuts down, outside the job's own handling (exit_cleanly, in
# main): rank 0 says it in one line, every rank exits 130, no traceback. The imports (torch's: a
# second or two) hold it until they are done.
OUTSIDE = "interrupted by Ctrl-C (SIGINT) while starting up or shutting down, outside training (exit code 130)"
SAYS = OUTSIDE if os.environ.get("RANK", "0") == "0" else None

with ctrl_c_held(SAYS):
    refuse_old_torch()  # an older torch than the floor: one line and exit 2, before torch or Hydra is imported
    import hydra
    from omegaconf import DictConfig

    from trainer.logger.base import MetricLogger
    from trainer.loop.summary import log_final_report
    from trainer.reliability import flight
    from trainer.setup import config as conf
    from trainer.setup import dist, precheck
    from trainer.setup.build import add_loggers, build_parts, build_trainer, check_device, prepare_data
    from trainer.setup.preflight import bytes_needed, check_output_dir


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    loggers: list[MetricLogger] = []
    # ConfigError -> one message (rank 0's) + exit 2; SIGTERM -> flush + exit 143; Ctrl-C -> exit 130
    with exit_cleanly(loggers, dist.prints_bad_input_error):
        config = conf.plain_config(cfg)
        launch = dist.read_launch_env()  # read here, not at import: submitit tasks unpickle main()
        parts = build_parts(cfg, launch.world_size)  # validated, then every constructor, before any collective
        settings = parts.settings
        kept = settings.keep_checkpoints if settings.checkpoint else None  # None: the run writes no checkpoint
        check_output_dir(conf.run_dir(), bytes_needed(parts.model, kept))  # full disk: fail now
        device = dist.resolve_device(settings.device, launch)
        check_device(parts, device)  # e.g. SyncBatchNorm needs CUDA: refused before any logger starts
        prefix = dist.group_key_prefix(launch, conf.job_num())  # a fresh prefix per multirun job
        flight.record(flight.entries(settings.flight_recorder, device.type))  # on before the group is made
        ctx = dist.init_process_group(launch, dist.job_store(launch), device, settings.collective_timeout_s, prefix)
        try:
            dist.check_ranks_agree("the job (number, overrides)", conf.job_identity())
            prepare_data(parts.data, ctx)
            run_dir = conf.run_dir()
            trainer = build_trainer(parts, ctx, [], run_dir, config)  # resumed: a finished run is known now
            if not trainer.finished_before:  # its re-run starts no logger: no empty W&B run, no rows touched
                add_loggers(loggers, cfg, config, ctx, run_dir, group=conf.job_name(cfg.run_name))
                trainer.attach_loggers(loggers)
            summary = trainer.fit()  # a finished run re-run trains nothing: one line says so, no report
            if ctx.is_main_process and not trainer.finished_before:
                log_final_report(summary)
            return summary
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    with stopped_by_ctrl_c(SAYS):
        launch = dist.read_launch_env()
        store = dist.job_store(launch)
        # Bad input stops every rank here (exit 2), before Hydra's app creates the run dir. The check
        # imports the strategy's modules: a Ctrl-C is held through it (see the imports above).
        with ctrl_c_held(SAYS):
            precheck.check_command_line(sys.argv[1:], launch.rank, dist.rank0_signal(store, launch), launch.world_size)
        conf.set_run_stamp(dist.agree_on_run_stamp(store, launch))
        main()
