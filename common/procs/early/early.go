// Package early applies procs.Set while the program's packages are still
// initializing. A main package imports it for that effect alone:
//
//	import _ "github.com/tandem-run/tandem/common/procs/early"
//
// Shrinking GOMAXPROCS hands the dropped Ps' cached spans back to the heap,
// and the first hand-back of each size class touches fresh memory. From
// main that was ~60 size classes, ~95 page faults of the runner's ~725
// between exec and its API answering; here, before most of the packages'
// allocations, there is little to hand back. Its place among the inits is
// Go's (import-path order among the ready ones): early, not first.
package early

import (
	"os"

	"github.com/tandem-run/tandem/common/procs"
)

func init() { procs.Set(os.Getenv) }
