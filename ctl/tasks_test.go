package ctl

import (
	"errors"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

func named(id, name string) api.TaskInfoResponse {
	return api.TaskInfoResponse{ID: id, Tandem: &api.TaskDetails{Name: name}}
}

func TestMatchByIDNameAndPrefix(t *testing.T) {
	tasks := []api.TaskInfoResponse{
		named("abc12345-0000", "train"),
		named("abd99999-0000", "abc"), // a name that is another task's prefix
		named("ffff0000-0000", ""),
	}
	for ref, want := range map[string]string{
		"abc12345-0000": "abc12345-0000", // exact id
		"train":         "abc12345-0000", // name
		"abc":           "abd99999-0000", // an exact name beats an id prefix
		"abd9":          "abd99999-0000", // unique prefix
		"f":             "ffff0000-0000",
	} {
		got, err := Match(tasks, ref)
		if err != nil || got.ID != want {
			t.Errorf("Match(%q) = %s, %v; want %s", ref, got.ID, err, want)
		}
	}
	if _, err := Match(tasks, "ab"); err == nil || !strings.Contains(err.Error(), "matches 2 tasks") {
		t.Errorf("ambiguous prefix: %v", err)
	}
	if _, err := Match(tasks, "zzz"); !errors.Is(err, ErrNoTask) {
		t.Errorf("no match: %v", err)
	}
	if _, err := Match(tasks, ""); err == nil {
		t.Error("empty ref matched")
	}
	// Two tasks of one name: neither is picked (a stop must not guess);
	// each id still works.
	twice := append(tasks, named("bbbb0000-0000", "train"))
	if got, err := Match(twice, "train"); err == nil || !strings.Contains(err.Error(), "2 tasks are named \"train\" (abc12345-0000, bbbb0000-0000)") {
		t.Errorf("a name two tasks have: %s, %v", got.ID, err)
	}
	if got, err := Match(twice, "bbbb0000-0000"); err != nil || got.ID != "bbbb0000-0000" {
		t.Errorf("by id among same names: %s, %v", got.ID, err)
	}
}

func TestRunnerPorts(t *testing.T) {
	ports := func(info api.TaskInfoResponse, http, ssh int) (Ports, error) {
		h, err := RunnerHTTPPort(info, http)
		if err != nil {
			return Ports{}, err
		}
		s, err := RunnerSSHPort(info, ssh)
		return Ports{h, s}, err
	}
	details := api.TaskInfoResponse{ID: "t", Tandem: &api.TaskDetails{RunnerHTTPPort: 20999, RunnerSSHPort: 20022}}
	if p, err := ports(details, 0, 0); err != nil || p != (Ports{20999, 20022}) {
		t.Errorf("from details: %+v %v", p, err)
	}
	if p, err := ports(details, 1, 0); err != nil || p != (Ports{1, 20022}) {
		t.Errorf("flags override: %+v %v", p, err)
	}
	// A shim without details (dstack's): its defaults, or the published
	// mapping in bridge mode.
	bare := api.TaskInfoResponse{ID: "t", Ports: []api.PortMapping{{Host: 32001, Container: 10999}}}
	if p, err := ports(bare, 0, 0); err != nil || p != (Ports{32001, 10022}) {
		t.Errorf("bare shim: %+v %v", p, err)
	}
	pending := api.TaskInfoResponse{ID: "t", Status: api.TaskPulling, Tandem: &api.TaskDetails{NetworkMode: "bridge"}}
	if _, err := RunnerHTTPPort(pending, 0); err == nil || HintOf(err) != HintRunnerPort {
		t.Errorf("no ports yet: %v", err)
	}
	if _, err := RunnerSSHPort(pending, 0); err == nil || HintOf(err) != HintRunnerSSHPort {
		t.Errorf("no ssh port yet: %v", err)
	}
	if p, err := RunnerSSHPort(pending, 2222); err != nil || p != 2222 {
		t.Errorf("a flag stands in for an unknown port: %d %v", p, err)
	}
}

func TestSSHEndpointOptions(t *testing.T) {
	ep := SSHEndpoint{Host: "10.0.0.5", Port: 10022, User: "root", Identity: "/home/a b/.ssh/id", Jump: "ubuntu@gpu:2222", KnownHosts: "/kh"}
	entry, err := SSHConfigEntry("train", "abc", "127.0.0.1:10998", ep)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"# tandem task abc shim 127.0.0.1:10998\nHost train\n", "  HostName 10.0.0.5\n", "  Port 10022\n",
		`  IdentityFile "/home/a b/.ssh/id"`,
		`  ProxyCommand ssh -o UserKnownHostsFile=/kh -i '/home/a b/.ssh/id' -o IdentitiesOnly=yes -p 2222 -W %h:%p ubuntu@gpu`} {
		if !strings.Contains(entry, want) {
			t.Errorf("entry lacks %q:\n%s", want, entry)
		}
	}
	plain, _ := SSHConfigEntry("x", "id", "s", SSHEndpoint{Host: "h", Port: 1, User: "root", Jump: "gpu"})
	if !strings.Contains(plain, "  ProxyJump gpu\n") || strings.Contains(plain, "IdentityFile") {
		t.Errorf("plain jump:\n%s", plain)
	}
	// A hostile shim's name or id cannot add lines to the ssh config.
	for _, bad := range [][2]string{{"x\n  ProxyCommand touch /tmp/pwned", "id"}, {"x", "id\nHost *"}, {"a b", "id"}, {"", "id"}} {
		if e, err := SSHConfigEntry(bad[0], bad[1], "s", ep); err == nil {
			t.Errorf("alias %q id %q accepted:\n%s", bad[0], bad[1], e)
		}
	}
	if got := shellQuote("it's"); got != `'it'\''s'` {
		t.Errorf("quote: %s", got)
	}
}
