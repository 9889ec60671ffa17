"""Training jobs: SWiRL (swirl.py: collect, judge, filter, offline step-wise RL, SFT, eval) on the
one offline loop (offline.py) and the one row packer (training/pack.py)."""
