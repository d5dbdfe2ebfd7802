#!/bin/bash
# usage: suite_ab.sh LABEL [extra pytest args]
# run as (01:25-02:05 UTC): suite_ab.sh trim_on; suite_ab.sh trim_off -p notrim_plugin (the plugin is
# ../../2026-11-29/load_memory/notrim_plugin.py, copied to /tmp); then (02:09) suite_ab.sh xdist_on -n 2 --dist loadfile
cd /work/wt/a
export PATH=/work/main/.venv/bin:$PATH
label=$1; shift
{ date -u; uptime; } > /tmp/suite_$label.txt
/usr/bin/time -v env PYTHONPATH=/work/wt/a:/tmp python -m pytest -q -p no:cacheprovider --durations=60 "$@" >> /tmp/suite_$label.txt 2>&1
{ date -u; uptime; } >> /tmp/suite_$label.txt
