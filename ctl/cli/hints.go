package cli

import (
	"errors"
	"net/http"
	"strconv"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

// hints say, in this CLI's flags, how to get past an error the library
// marked with a ctl.Hint.
var hints = map[ctl.Hint]string{
	ctl.HintRunnerPort:    " (if the shim runs it elsewhere, give --runner-port)",
	ctl.HintRunnerSSHPort: "; give it with --runner-ssh-port",
	ctl.HintBridgeNetwork: "\nuse --network bridge, or stop that task (tandem stop NAME)",
	ctl.HintPortsTaken:    "\nstop that process, or use --network bridge (the shim forwards a bridge task's ports from free ones)",
	ctl.HintNodeIP:        "\ngive each node's address with --node-ip, in node order",
	ctl.HintForce:         " (tandem stop), or use --force",
	ctl.HintRemoveRunning: ": stop it first (tandem stop), or add -f to stop and remove it (tandem rm -f)",
	ctl.HintBinaries:      ": give --shim-binary and --runner-binary, or --dist (a `make release` directory)",
}

// shimUnreachableHint is what to do when no shim answers.
const shimUnreachableHint = "start one (dstack-shim on that host, or tandem host install), or give its address with --shim HOST:PORT (or TANDEM_SHIM)"

// checkShimAddr is what to check when the address does not answer as a
// shim does.
func checkShimAddr() string {
	return "check its host and port (--shim; dstack's shim listens on " + strconv.Itoa(api.ShimHTTPPort) + "), or whether a proxy on the way answers for it"
}

// errText is err for people: its text and the hint it carries, if any. A
// shim's 401 says how to give it its token, whichever command met it; a
// 404 where every dstack-shim answers says that no shim is there.
// Its text is printable: an error may carry a shim's or a runner's words
// (a task's name, its status), and those are hostile until checked.
func errText(err error) string {
	var ue *ctl.ShimUnreachableError
	if errors.As(err, &ue) {
		// One voice whatever the command: what it was doing is no help.
		return api.PrintableLines(ue.Error()) + "\n" + shimUnreachableHint
	}
	text := api.PrintableLines(err.Error()) + hints[ctl.HintOf(err)]
	var se *api.StatusError
	if !errors.As(err, &se) {
		return text
	}
	notFound := se.Code == http.StatusNotFound && se.Method == http.MethodGet
	switch {
	case se.Code == http.StatusUnauthorized:
		text += "\nthe shim was started with --api-token: give it with --shim-token or TANDEM_SHIM_API_TOKEN"
	case notFound && se.Path == "/api/healthcheck":
		text += "\nno dstack-shim serves that address: " + checkShimAddr()
	case notFound && se.Path == "/api/tasks":
		text += "\nthe server there keeps no tasks: not a dstack-shim, or one older than dstack's task API: " + checkShimAddr()
	}
	return text
}
