# What every GPU session script shares (source it after setting $stage): results go to $OUT/r and
# come back as $OUT/results-$stage.tgz; T LIMIT NAME CMD... runs one part with a time limit into
# $R/NAME.txt (its exit status and wall seconds appended) and prints its tail.
R=$OUT/r; mkdir -p "$R"
export PYTHONUNBUFFERED=1 OUT
log() { echo "== $* ($(date +%T))"; }
T() { local t=$1 name=$2; shift 2; log "$name"; local s=$SECONDS; timeout "$t" "$@" > "$R/$name.txt" 2>&1; echo "rc=$? wall_s=$((SECONDS - s))" >> "$R/$name.txt"; tail -4 "$R/$name.txt"; }
finish() { tar czf "$OUT/results-$stage.tgz" -C "$OUT" r && rm -rf "$R"; }
trap finish EXIT
