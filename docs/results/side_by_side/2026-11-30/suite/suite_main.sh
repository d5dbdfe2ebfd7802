#!/bin/bash
# usage: suite_main.sh LABEL [extra pytest args]: the suite at /work/main's working tree
# run as: suite_main.sh xdist_new -n 2 --dist loadfile (02:23); suite_main.sh xdist_pin -n 2 --dist loadfile (02:37)
cd /work/main
export PATH=/work/main/.venv/bin:$PATH
label=$1; shift
export TIMELINE_LOG=/tmp/timeline_$label.txt
rm -f $TIMELINE_LOG
{ date -u; uptime; git log --oneline -1; git status --short; } > /tmp/suite_$label.txt
/usr/bin/time -v env PYTHONPATH=/work/main:/tmp python -m pytest -q -p no:cacheprovider -p timeline_plugin --durations=60 "$@" >> /tmp/suite_$label.txt 2>&1
{ date -u; uptime; } >> /tmp/suite_$label.txt
