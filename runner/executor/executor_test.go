package executor

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/runner/account"
)

func TestJobEnvOrderAndProfile(t *testing.T) {
	b := api.SubmitBody{
		Run:           api.Run{ID: "r", RunSpec: api.RunSpec{RunName: "name", RepoID: "rid"}},
		JobSubmission: api.JobSubmission{ID: "j"},
		JobSpec:       api.JobSpec{JobNum: 1, JobsPerReplica: 2, Env: map[string]string{"A": "spec", "DSTACK_RUN_NAME": "override", "Q": "it's"}},
		ClusterInfo:   api.ClusterInfo{JobIPs: []string{"10.0.0.1", "10.0.0.2"}, MasterJobIP: "10.0.0.1", GPUsPerJob: 4},
		Secrets:       map[string]string{"A": "secret", "S": "s"},
	}
	env := JobEnv([]string{"A=base", "PATH=/bin", "HOME=/wrong", "BASH_FUNC_f%%=() { :; }", "B=base"}, b, "/repo", "/wd", "/dstack/mpi/hostfile", "/home/u")
	want := map[string]string{"A": "spec", "B": "base", "S": "s", "PATH": "/bin", "HOME": "/home/u", "DSTACK_RUN_NAME": "override",
		"DSTACK_NODES_IPS": "10.0.0.1\n10.0.0.2", "DSTACK_NODE_RANK": "1", "DSTACK_NODES_NUM": "2", "DSTACK_GPUS_NUM": "8",
		"DSTACK_GPUS_PER_NODE": "4", "DSTACK_WORKING_DIR": "/wd", "DSTACK_REPO_DIR": "/repo", "DSTACK_MPI_HOSTFILE": "/dstack/mpi/hostfile"}
	for k, v := range want {
		if env[k] != v {
			t.Errorf("%s = %q want %q", k, env[k], v)
		}
	}
	if _, ok := env["BASH_FUNC_f%%"]; ok {
		t.Error("exported bash functions must be dropped")
	}
	dir := t.TempDir()
	p := Paths{DstackDir: filepath.Join(dir, "dstack"), EtcProfile: filepath.Join(dir, "etc", "profile")}
	_ = os.MkdirAll(filepath.Dir(p.EtcProfile), 0o755)
	for i := 0; i < 2; i++ {
		if err := WriteProfile(p, env); err != nil {
			t.Fatal(err)
		}
	}
	prof, _ := os.ReadFile(p.ProfilePath())
	if !strings.Contains(string(prof), `export Q='it'"'"'s'`) || strings.Contains(string(prof), "export HOME=") ||
		!strings.HasSuffix(string(prof), "cd \"$DSTACK_WORKING_DIR\"\n") {
		t.Fatalf("profile:\n%s", prof)
	}
	etc, _ := os.ReadFile(p.EtcProfile)
	if strings.Count(string(etc), ". '"+p.ProfilePath()+"'") != 1 {
		t.Fatalf("hook must be added once:\n%s", etc)
	}
	if err := WriteHostfile(p, b.ClusterInfo); err != nil {
		t.Fatal(err)
	}
	hf, _ := os.ReadFile(p.HostfilePath())
	if string(hf) != "10.0.0.1 slots=4\n10.0.0.2 slots=4\n" {
		t.Fatalf("hostfile %q", hf)
	}
	b.ClusterInfo.JobIPs = []string{"10.0.0.1", ""}
	_ = WriteHostfile(p, b.ClusterInfo)
	if hf, _ := os.ReadFile(p.HostfilePath()); len(hf) != 0 {
		t.Fatalf("an unknown IP makes the hostfile empty: %q", hf)
	}
}

func TestExpandPath(t *testing.T) {
	for _, tc := range []struct{ in, home, base, want, err string }{
		{"~", "/home/u", "", "/home/u", ""},
		{"~/a/../b", "/home/u", "", "/home/u/b", ""},
		{"rel", "/home/u", "/wd", "/wd/rel", ""},
		{"rel", "/home/u", "", "", "must be absolute"},
		{"~bob/x", "/home/u", "", "", "~user"},
	} {
		got, err := ExpandPath(tc.in, tc.home, tc.base)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: err %v", tc.in, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%q: %q %v", tc.in, got, err)
		}
	}
}

func newTestExecutor(t *testing.T) *Executor {
	t.Helper()
	x, err := New(Config{TempDir: t.TempDir(), PullCap: 100})
	if err != nil {
		t.Fatal(err)
	}
	return x
}

func TestStateMachine(t *testing.T) {
	x := newTestExecutor(t)
	if err := x.UploadCode(strings.NewReader("x")); !errors.Is(err, ErrState) {
		t.Fatalf("upload before submit: %v", err)
	}
	if _, _, err := x.Run(); !errors.Is(err, ErrState) {
		t.Fatalf("run before submit: %v", err)
	}
	if err := x.Submit(api.SubmitBody{}); err != nil {
		t.Fatal(err)
	}
	if err := x.Submit(api.SubmitBody{}); err != nil {
		t.Fatal("re-submit before run is allowed:", err)
	}
	for _, id := range []string{"", ".", "..", "a/b", "../x", "a\\b"} {
		if err := x.UploadArchive(id, strings.NewReader("")); !errors.Is(err, ErrBadInput) {
			t.Fatalf("archive id %q: %v", id, err)
		}
	}
	x.Stop() // stop before run ends the wait for a job
	if x.State() != WaitLogsFinished {
		t.Fatalf("state %s", x.State())
	}
	if err := x.Submit(api.SubmitBody{}); !errors.Is(err, ErrState) {
		t.Fatalf("submit after stop: %v", err)
	}
}

// TestJobStatesFollowTheTable: a state the table refuses is never recorded.
func TestJobStatesFollowTheTable(t *testing.T) {
	x := newTestExecutor(t)
	x.appendState(api.JobStateEvent{State: api.JobDone}) // done without running
	x.appendState(api.JobStateEvent{State: api.JobRunning})
	x.appendState(api.JobStateEvent{State: api.JobRunning}) // twice
	x.appendState(api.JobStateEvent{State: api.JobTerminated})
	x.appendState(api.JobStateEvent{State: api.JobDone}) // after the end
	p, err := x.Pull(0)
	if err != nil {
		t.Fatal(err)
	}
	var got []api.JobState
	for _, s := range p.JobStates {
		got = append(got, s.State)
	}
	if len(got) != 2 || got[0] != api.JobRunning || got[1] != api.JobTerminated {
		t.Fatalf("states %v", got)
	}
}

func TestGitCredentials(t *testing.T) {
	home := t.TempDir()
	u := account.JobUser{Home: home, ProvisionHome: true}
	cleanup, err := writeGitCredentials(&api.RepoCredentials{CloneURL: "https://github.com/a/b.git", OAuthToken: "tok"}, u, false)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(home, ".config", "gh", "hosts.yml"))
	if err != nil || string(b) != "github.com:\n    oauth_token: \"tok\"\n" {
		t.Fatalf("hosts.yml %q %v", b, err)
	}
	if _, err := writeGitCredentials(&api.RepoCredentials{CloneURL: "https://github.com/a/b.git", OAuthToken: "x"}, u, false); err == nil {
		t.Fatal("an existing file must not be overwritten")
	}
	cleanup()
	if _, err := os.Stat(filepath.Join(home, ".config", "gh", "hosts.yml")); !os.IsNotExist(err) {
		t.Fatal("cleanup must remove the file")
	}
	cleanup, err = writeGitCredentials(&api.RepoCredentials{CloneURL: "ssh://git@host/r.git", PrivateKey: "KEY"}, u, false)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(home, ".ssh", "id_rsa")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("id_rsa: %v %v", fi, err)
	}
	cleanup()
	if _, err := writeGitCredentials(&api.RepoCredentials{CloneURL: "ssh://git@host/r.git"}, u, false); err == nil {
		t.Fatal("ssh without a key must fail")
	}
	if c, err := writeGitCredentials(&api.RepoCredentials{CloneURL: "https://h/r"}, account.JobUser{Home: "/", ProvisionHome: false}, false); err != nil || c == nil {
		t.Fatal("no home provisioning: nothing to do")
	}
}

// TestClusterKeyAuthorizedAtRun: a multi-node job's key is authorized by
// this node's SSH server only when its job runs, from the submit that runs
// (the server runs a master once every other node runs); a submit that was
// replaced leaves no key and no upload behind; a malformed key fails the
// submit.
func TestClusterKeyAuthorizedAtRun(t *testing.T) {
	const attacker = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHh3eXl4c2VjcmV0YXR0YWNrZXJrZXlmb3J0ZXN0c3MK attacker"
	const real = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIC8yVbSqjrvTJsNrx0BHW0YaJvTxdnsM3I1dTKdJjLKu job"
	var authorized []string
	tmp := t.TempDir()
	x, _ := New(Config{TempDir: tmp, SSHPort: 10022, AuthorizeKey: func(l string) error {
		authorized = append(authorized, l)
		return nil
	}})
	t.Cleanup(func() { x.Close() })
	wd := t.TempDir()
	b := api.SubmitBody{JobSpec: api.JobSpec{SSHKey: &api.SSHKey{Private: "PRIVATE", Public: attacker}, Commands: []string{"true"}, WorkingDir: &wd, RepoDir: &wd},
		ClusterInfo: api.ClusterInfo{JobIPs: []string{"10.0.0.1", "10.0.0.2"}}}
	if err := x.Submit(b); err != nil {
		t.Fatal(err)
	}
	if err := x.UploadCode(strings.NewReader("attacker's code")); err != nil {
		t.Fatal(err)
	}
	if len(authorized) != 0 {
		t.Fatalf("a submit authorized %v before its run", authorized)
	}
	b.JobSpec.SSHKey.Public = real
	if err := x.Submit(b); err != nil {
		t.Fatal(err)
	}
	if x.codeBlob {
		t.Fatal("the replaced submit's code upload is still used")
	}
	if blobs, _ := os.ReadDir(filepath.Join(tmp, "repo_blobs")); len(blobs) != 0 {
		t.Fatalf("the replaced submit's upload is still on disk: %v", blobs)
	}
	if _, started, err := x.Run(); err != nil || !started {
		t.Fatalf("run: %v %v", started, err)
	}
	waitFinished(t, x)
	if len(authorized) != 1 || authorized[0] != real {
		t.Fatalf("authorized %v, want only the key of the submit that ran", authorized)
	}
	y, _ := New(Config{TempDir: t.TempDir(), SSHPort: 10022, AuthorizeKey: func(string) error { return nil }})
	b.JobSpec.SSHKey.Public = "garbage"
	if err := y.Submit(b); !errors.Is(err, ErrBadInput) || y.State() != WaitSubmit {
		t.Fatalf("malformed key: %v, state %s", err, y.State())
	}
	// Single node: no key to authorize.
	z, _ := New(Config{TempDir: t.TempDir(), SSHPort: 10022, AuthorizeKey: func(l string) error { t.Errorf("authorized %q", l); return nil }})
	t.Cleanup(func() { z.Close() })
	b.ClusterInfo.JobIPs = []string{"10.0.0.1"}
	if err := z.Submit(b); err != nil {
		t.Fatal(err)
	}
	if _, _, err := z.Run(); err != nil {
		t.Fatal(err)
	}
	waitFinished(t, z)
}

// waitFinished waits for x's job to end and be recorded, so that nothing
// writes into the test's temp dirs after the test.
func waitFinished(t *testing.T, x *Executor) {
	t.Helper()
	select {
	case <-x.Finished():
	case <-time.After(20 * time.Second):
		t.Fatal("the job did not finish")
	}
}

func TestClusterSSH(t *testing.T) {
	home := t.TempDir()
	var authorized []string
	x, _ := New(Config{TempDir: t.TempDir(), SSHPort: 10022, AuthorizeKey: func(l string) error { authorized = append(authorized, l); return nil }})
	b := api.SubmitBody{JobSpec: api.JobSpec{SSHKey: &api.SSHKey{Private: "PRIVATE", Public: "ssh-ed25519 AAAA job"}},
		ClusterInfo: api.ClusterInfo{JobIPs: []string{"10.0.0.1", "10.0.0.2"}}}
	if err := x.setupClusterSSH(b, account.JobUser{Home: home, ProvisionHome: true}); err != nil {
		t.Fatal(err)
	}
	key, _ := os.ReadFile(filepath.Join(home, ".ssh", "dstack_job"))
	cfg, _ := os.ReadFile(filepath.Join(home, ".ssh", "config"))
	if string(key) != "PRIVATE\n" || strings.Count(string(cfg), "Port 10022") != 2 || !strings.Contains(string(cfg), "Host 10.0.0.2\n") ||
		!strings.Contains(string(cfg), "IdentityFile "+filepath.Join(home, ".ssh", "dstack_job")) {
		t.Fatalf("key %q config:\n%s", key, cfg)
	}
	if len(authorized) != 0 {
		t.Fatalf("the cluster files step authorized %v (run does it)", authorized)
	}
	// Single node: nothing.
	other := t.TempDir()
	b.ClusterInfo.JobIPs = []string{"10.0.0.1"}
	_ = x.setupClusterSSH(b, account.JobUser{Home: other, ProvisionHome: true})
	if _, err := os.Stat(filepath.Join(other, ".ssh")); !os.IsNotExist(err) {
		t.Fatal("single-node jobs get no cluster ssh files")
	}
}

// Followers is idle with none served, busy while one is, and a follower
// that joins while the last one's end is awaited is waited for too: an
// Idle asked after it joined waits for it (a WaitGroup would panic or
// miss it). Leaving twice counts once.
func TestFollowersIdleAndJoinWhileWaited(t *testing.T) {
	var f Followers
	isIdle := func() bool {
		select {
		case <-f.Idle():
			return true
		default:
			return false
		}
	}
	if !isIdle() {
		t.Fatal("none joined: not idle")
	}
	leaveA := f.Join()
	waited := f.Idle()
	leaveB := f.Join()
	leaveA()
	leaveA()
	if isIdle() {
		t.Fatal("idle while B is served (A left twice)")
	}
	leaveB()
	select {
	case <-waited:
	default:
		t.Fatal("the wait begun with A served did not end once both left")
	}
	leaveC := f.Join()
	if isIdle() {
		t.Fatal("idle while C, joined after an idle spell, is served")
	}
	leaveC()
	if !isIdle() {
		t.Fatal("not idle once C left")
	}
}

// An executor given no Paths keeps the job's profile and MPI hostfile
// under its temp dir: a relative path wrote them into the process's
// working dir (the package dir, for a test).
func TestUnsetPathsStayUnderTheTempDir(t *testing.T) {
	tmp := t.TempDir()
	c := Config{TempDir: tmp}.WithDefaults()
	for _, p := range []string{c.Paths.HostfilePath(), c.Paths.ProfilePath(), c.Paths.EtcProfile} {
		if !strings.HasPrefix(p, tmp+string(filepath.Separator)) {
			t.Errorf("%s is not under the temp dir %s", p, tmp)
		}
	}
	given := Config{TempDir: tmp, Paths: Paths{DstackDir: "/dstack", EtcProfile: "/etc/profile"}}.WithDefaults()
	if given.Paths.DstackDir != "/dstack" || given.Paths.EtcProfile != "/etc/profile" {
		t.Errorf("given paths changed: %+v", given.Paths)
	}
}
