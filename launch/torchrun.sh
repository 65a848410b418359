#!/usr/bin/env bash
# A run started by torchrun: the same command on every machine, one node process per machine.
#
#   export RLASYNC_CLUSTER_SECRET=...     # the same secret on every machine (`rlasync secret`)
#   NNODES=3 HEAD=10.0.0.1 bash launch/torchrun.sh configs/quickstart_cluster.yaml train.steps=600
#
# Restarts (a machine lost, a node failed): MAX_RESTARTS=N lets torchrun start the whole group
# again up to N times; with --resume=auto the same command continues from the newest checkpoint
# (a run that ends early stops every node with exit code 3, so every agent restarts its node).
#
#   MAX_RESTARTS=3 NNODES=3 HEAD=10.0.0.1 bash launch/torchrun.sh configs/quickstart_cluster.yaml train.steps=600 --resume=auto
#
# torchrun's c10d rendezvous (at HEAD:29400) numbers the machines; the one that gets rank 0 is
# the head (the controller) and the others join it. The trainer's torch.distributed group meets
# at the same store (MASTER_ADDR:MASTER_PORT). --nproc-per-node=G is read as "G devices here":
# local rank 0 becomes the node and starts its per-GPU processes itself, the others exit at once.
# LOCAL_ADDR: this machine's address the others reach (torchrun otherwise uses its hostname).
set -euo pipefail
: "${RLASYNC_CLUSTER_SECRET:?export RLASYNC_CLUSTER_SECRET (the same on every machine; make one with rlasync secret)}"
: "${NNODES:?set NNODES, the number of machines}"
: "${HEAD:?set HEAD, the address of the machine that hosts the rendezvous}"
PYTHON=${PYTHON:-python}
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --nproc-per-node="${NPROC_PER_NODE:-1}" --max-restarts="${MAX_RESTARTS:-0}" \
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD:${RDZV_PORT:-29400}" --rdzv-id="${RDZV_ID:-rlasync}" \
    ${LOCAL_ADDR:+--local-addr="$LOCAL_ADDR"} \
    -m rlasync launch --from-env "$@"
