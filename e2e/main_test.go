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
