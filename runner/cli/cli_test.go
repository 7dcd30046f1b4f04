package cli

import (
	"context"
	"reflect"
	"testing"
	"time"

	"github.com/tandem-run/tandem/runner/agent"
)

// capture runs the start command with args and returns the config the
// flags made.
func capture(t *testing.T, args ...string) agent.Config {
	t.Helper()
	var got agent.Config
	a := app(func(_ context.Context, cfg agent.Config) error { got = cfg; return nil })
	if err := a.Run(append([]string{"dstack-runner"}, args...)); err != nil {
		t.Fatal(err)
	}
	return got
}

func TestStartFlagsDefaultToTheComponents(t *testing.T) {
	// No flags: exactly the defaults the runner and its components use
	// when built without flags (one source for both).
	got := capture(t, "start")
	want := agent.Defaults()
	want.AuthorizedKeys = []string{} // the flag's empty list
	if got.AuthorizedKeys == nil {
		got.AuthorizedKeys = []string{}
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("flags without values:\n got %+v\nwant %+v", got, want)
	}
}

func TestStartFlagsReachTheComponents(t *testing.T) {
	got := capture(t, "--log-level", "debug", "start", "--ssh-log-level", "warn", "--ssh-max-startups", "5", "--ssh-ciphers", "aes128-ctr,aes256-gcm@openssh.com",
		"--interrupt-grace", "7s", "--job-log-max-bytes", "-1", "--max-upload-bytes", "1024", "--ssh-gateway-ports", "--http-port", "11999")
	switch {
	case got.SSH.MaxStartups != 5 || !got.SSH.GatewayPorts || !reflect.DeepEqual(got.SSH.Ciphers, []string{"aes128-ctr", "aes256-gcm@openssh.com"}):
		t.Errorf("ssh: %+v", got.SSH)
	case got.Executor.InterruptGrace != 7*time.Second || got.Executor.MaxUpload != 1024 || got.Executor.LogRetention.Max != -1:
		t.Errorf("executor: %+v", got.Executor)
	case got.HTTPPort != 11999 || got.LogLevel.String() != "DEBUG" || got.SSHLogLevel.String() != "WARN":
		t.Errorf("runner: port %d level %s ssh level %s", got.HTTPPort, got.LogLevel, got.SSHLogLevel)
	}
}
