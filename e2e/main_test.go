package e2e

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// TestMain fails the suite when a daemon a test started is still alive
// after every test's cleanup ran.
func TestMain(m *testing.M) {
	if mode := os.Getenv("TANDEM_E2E_FDPASS"); mode != "" {
		os.Exit(fdPassMain(mode)) // a helper process of TestPassedSocketIsJudgedByItsHolder
	}
	// Every shim the suite starts has image GC off unless its test turns
	// it on: on a machine whose disk is past 85% a test's shim would
	// remove the machine's other images, or a test's own between its load
	// and its use.
	if os.Getenv("TANDEM_SHIM_IMAGE_GC") == "" {
		_ = os.Setenv("TANDEM_SHIM_IMAGE_GC", "false")
	}
	code := m.Run()
	if helpers.dir != "" {
		_ = os.RemoveAll(helpers.dir)
	}
	if left := testenv.LeftoverDaemons(); len(left) > 0 {
		fmt.Fprintf(os.Stderr, "e2e: daemons still running after the suite:\n  %s\n", strings.Join(left, "\n  "))
		code = 1
	}
	os.Exit(code)
}
