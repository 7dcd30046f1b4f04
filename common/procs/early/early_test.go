package early_test

import (
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"

	_ "github.com/tandem-run/tandem/common/procs/early"

	"github.com/tandem-run/tandem/common/procs"
)

// The child's report: GOMAXPROCS as main found it, before any test ran.
var atStart = runtime.GOMAXPROCS(0)

// TestSetBeforeMain runs this test binary again without GOMAXPROCS in its
// environment (and with Go's own cgroup limit off, so the CPUs Go finds are
// the machine's): the import alone must have set procs.For of them.
func TestSetBeforeMain(t *testing.T) {
	if os.Getenv("EARLY_CHILD") == "1" {
		t.Logf("GOMAXPROCS=%d", atStart)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^TestSetBeforeMain$", "-test.v")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GOMAXPROCS=") && !strings.HasPrefix(kv, "GODEBUG=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "EARLY_CHILD=1", "GODEBUG=cgroupgomaxprocs=0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	_, after, ok := strings.Cut(string(out), "GOMAXPROCS=")
	if !ok {
		t.Fatalf("child reported nothing:\n%s", out)
	}
	got, err := strconv.Atoi(strings.Fields(after)[0])
	if err != nil {
		t.Fatal(err)
	}
	if want := procs.For(runtime.NumCPU()); got != want {
		t.Fatalf("GOMAXPROCS at main = %d, want procs.For(%d CPUs) = %d", got, runtime.NumCPU(), want)
	}
	// The environment still wins.
	cmd = exec.Command(os.Args[0], "-test.run", "^TestSetBeforeMain$", "-test.v")
	cmd.Env = append(os.Environ(), "EARLY_CHILD=1", "GOMAXPROCS=3")
	if out, err = cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "GOMAXPROCS=3") {
		t.Fatalf("with GOMAXPROCS=3 in the environment: %v\n%s", err, out)
	}
}
