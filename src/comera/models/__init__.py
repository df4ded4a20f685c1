"""Building blocks the workloads' models share: attention (:mod:`.attention`, :mod:`.blocked_attention`) and a
dropout with cheap random draws (:mod:`.dropout`). The models themselves live in their workloads' folders."""
