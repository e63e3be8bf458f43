// Package npd pins kubernetes/node-problem-detector, built from Go modules for the side-by-side
// benchmark (bench/npd_compare.py). Built by tools/npd/build.sh; nothing here is imported.
package npd
