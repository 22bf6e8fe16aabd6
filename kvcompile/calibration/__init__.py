"""What every compile command shares around its recipe: the calibration corpus, the job, its checkpoints, shares
and separate jobs' partial statistics, the processes of a distributed run, the forwards' cost estimate."""
