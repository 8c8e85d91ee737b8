#!/bin/sh
# Container entry point: `skippipe node run` with the container's defaults, plus swarm bootstrap by file.
#
# Compose runs one bootstrap and N nodes. The bootstrap's peer id is only known once it has started, so:
#   SKIPPIPE_ROLE=bootstrap  writes its status (peer id, addresses) to $SKIPPIPE_BOOTSTRAP_FILE;
#   SKIPPIPE_ROLE=node       waits for that file and joins /dns4/$SKIPPIPE_BOOTSTRAP_HOST/tcp/31337/p2p/<id>.
# Any other arguments are passed to `skippipe node run` unchanged.
set -eu
ROLE=${SKIPPIPE_ROLE:-standalone}
FILE=${SKIPPIPE_BOOTSTRAP_FILE:-/swarm/bootstrap.json}
HOST=${SKIPPIPE_BOOTSTRAP_HOST:-bootstrap}
WAIT_S=${SKIPPIPE_BOOTSTRAP_WAIT_S:-120}

case "$ROLE" in
  bootstrap)
    rm -f "$FILE"
    exec skippipe node run --new-swarm --ready-file "$FILE" "$@"
    ;;
  node)
    waited=0
    while [ ! -s "$FILE" ]; do
      if [ "$waited" -ge "$WAIT_S" ]; then
        echo "error: bootstrap did not write $FILE within ${WAIT_S}s" >&2
        exit 2
      fi
      sleep 1
      waited=$((waited + 1))
    done
    PEER_ID=$(python -c 'import json,sys; print(json.load(open(sys.argv[1]))["peer_id"])' "$FILE")
    exec skippipe node run --initial-peers "/dns4/$HOST/tcp/31337/p2p/$PEER_ID" "$@"
    ;;
  *)
    exec skippipe node run "$@"
    ;;
esac
