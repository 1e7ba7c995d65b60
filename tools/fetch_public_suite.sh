#!/usr/bin/env bash
# The public Harbor-format task suite Gyre is checked on (issue 25): 16 tasks written by others, taken
# from three public repositories at fixed commits. Nothing of theirs is committed here; this script says
# exactly which repository, commit and paths make the suite and puts them in DEST (default /tmp/h8/suite).
#
#   tools/fetch_public_suite.sh [DEST]                      # clones from github.com (needs the network)
#   MIRRORS=/work/.mirror tools/fetch_public_suite.sh DEST  # or from local bare copies <owner>+<name>/repo
#
# Then (docs/tasks.md, "Environment images"; bases the machine cannot make are stand-ins, named as such):
#   python -m tools.make_base_images --store BASES --stand-in ubuntu:24.04=debian:bookworm \
#       --stand-in python:3.12-slim=python:3.11-slim --stand-in python:3.12-slim-bookworm=python:3.11-slim
#   python -m tools.check_tasks DEST --build-images --images BASES --jobs 2 --json verdicts.json
set -euo pipefail

DEST=${1:-/tmp/h8/suite}
MIRRORS=${MIRRORS:-}

# repository  commit  licence  task paths (each a Harbor task directory)
SUITE=(
  "harbor-framework/harbor-cookbook e093c9a860b988d9d74901010ddddb9c7f124f92 Apache-2.0
   harbor_cookbook/recipes/dns-blacklisting harbor_cookbook/recipes/mcp-tools harbor_cookbook/recipes/multi-container
   harbor_cookbook/recipes/multi-reward harbor_cookbook/recipes/multi-step harbor_cookbook/recipes/simple-task
   harbor_cookbook/recipes/simulated-user harbor_cookbook/recipes/skills"
  "AbdulGhaffarcs/harbor-tasks 9089dd6b063e32d2af77a8e8912cdaf0c5901360 CC0-1.0
   contributor-tasks/chromatic-sorting-matrix contributor-tasks/floor-plan-svg-annotation
   contributor-tasks/sokoban-from-image contributor-tasks/synthetic-histology-segmentation
   contributor-tasks/synthetic-topographic-contour-analysis"
  "bencalvert04/harbor-tasks 4c7a1f04fd97a1ad15f34e747df5d4a9b0983d78 none-stated
   scheduler solid-bg-removal ssh-key-pair"
)

git_dir() {  # a bare copy of $1 holding commit $2
  local repo=$1 commit=$2 local_copy="$MIRRORS/${1/\//+}/repo"
  if [[ -n $MIRRORS && -d $local_copy ]]; then
    echo "$local_copy"
    return
  fi
  local clone="$DEST/.git-${repo/\//+}"
  [[ -d $clone ]] || git clone --quiet --bare --filter=blob:none "https://github.com/$repo" "$clone" >&2
  git --git-dir="$clone" cat-file -e "$commit^{commit}" || git --git-dir="$clone" fetch --quiet origin "$commit" >&2
  echo "$clone"
}

mkdir -p "$DEST"
for entry in "${SUITE[@]}"; do
  read -r repo commit licence paths <<<"$(echo $entry)"
  gd=$(git_dir "$repo" "$commit")
  for path in $paths; do
    name=$(basename "$path")
    rm -rf "${DEST:?}/$name"
    staging=$(mktemp -d)
    git --git-dir="$gd" archive "$commit" "$path" | tar x -C "$staging"
    mv "$staging/$path" "$DEST/$name"
    rm -rf "$staging"
    echo "$name  $repo@${commit:0:12}:$path  ($licence)"
  done
done
