"""A scaling model: predicted step time and efficiency of every sync strategy at N ranks on a network.

    python -m trainer.scaling --run <run dir> --ranks 2,8,64,512 --network ib-ndr400 --gpus-per-node 8

trainer/links.py prices one collective (ring algorithms, alpha-beta model, by the group's ranks);
networks.py holds the presets and fits alpha and beta to the collective benchmark's JSON;
profile.py reads what a finished run measured; options.py builds conf/sync's strategies and asks
each what its step sends (SyncStrategy.schedule); predict.py lays those collectives over that
compute; report.py prints, plots and writes the predictions; __main__.py is the command line.
"""
