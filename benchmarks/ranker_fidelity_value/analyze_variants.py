import gzip
import json
import sys

import numpy as np

from eval.ranking_fidelity import spearman

rows = json.loads(gzip.open(sys.argv[1]).read() if str(sys.argv[1]).endswith('.gz') else open(sys.argv[1]).read())
eps = {}
for r in rows:
    eps.setdefault((r["sample"], r["budget"]), []).append(r)
L = len(rows[0]["layer_max"])


def weights(kind):
    w = np.ones(L)
    if kind == "first_half":
        w[L // 2 :] = 0
    if kind == "second_half":
        w[: L // 2] = 0
    if kind == "decay":
        w = 1.0 / (1 + np.arange(L))
    return w / w.sum()


res = {}
for var in ("layer_max", "layer_mean", "layer_max_abs", "layer_mean_abs", "layer_headmean"):
    for wk in ("uniform", "first_half", "second_half", "decay"):
        w = weights(wk)
        rhos = []
        for _, g in sorted(eps.items()):
            rep = [float(np.dot(w, r[var])) for r in g]
            rhos.append(spearman(rep, [r["live_kl"] for r in g]))
        res[(var, wk)] = rhos
        print(f"{var:16s} {wk:12s} mean {np.mean(rhos):.3f} min {np.min(rhos):.2f} n>=0.8 {sum(x>=0.8 for x in rhos)}/{len(rhos)}")
