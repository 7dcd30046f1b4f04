package account

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/tandem-run/tandem/api"
)

func fixtureRoot(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	_ = os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	_ = os.MkdirAll(filepath.Join(root, "home", "alice"), 0o755)
	_ = os.MkdirAll(filepath.Join(root, "root"), 0o755)
	_ = os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte(`root:x:0:0:root:/root:/bin/bash
alice:x:1000:1000::/home/alice:/bin/bash
svc:x:998:998::/nonexistent:/usr/sbin/nologin
ghost:x:997:997::/home/ghost:/bin/sh
rel:x:996:996::relative/home:/bin/sh
`), 0o644)
	_ = os.WriteFile(filepath.Join(root, "etc", "group"), []byte(`root:x:0:
video:x:44:alice
docker:x:999:alice,bob
alice:x:1000:
svc:x:998:
`), 0o644)
	return root
}

func TestResolveUser(t *testing.T) {
	a := Accounts{Root: fixtureRoot(t)}
	i := func(v int) *int { return &v }
	s := func(v string) *string { return &v }
	tests := []struct {
		name    string
		in      *api.JobUser
		want    JobUser
		wantErr string
	}{
		{"no user: the runner's own", nil, JobUser{UID: 0, GID: 0, Groups: []int{0}, Username: "root", Home: "/root", ProvisionHome: true}, ""},
		{"by name with supplementary groups", &api.JobUser{Username: s("alice")},
			JobUser{UID: 1000, GID: 1000, Groups: []int{44, 999, 1000}, Username: "alice", Home: "/home/alice", ProvisionHome: true}, ""},
		{"uid wins over name", &api.JobUser{UID: i(0), Username: s("alice")}, JobUser{UID: 0, GID: 0, Groups: []int{0}, Username: "root", Home: "/root", ProvisionHome: true}, ""},
		{"unknown uid is tolerated", &api.JobUser{UID: i(4242)}, JobUser{UID: 4242, GID: 0, Groups: []int{0}, Home: "/", ProvisionHome: false}, ""},
		{"gid given", &api.JobUser{Username: s("alice"), GID: i(5)}, JobUser{UID: 1000, GID: 5, Groups: []int{5}, Username: "alice", Home: "/home/alice", ProvisionHome: true}, ""},
		{"groupname given", &api.JobUser{Username: s("alice"), Groupname: s("video")}, JobUser{UID: 1000, GID: 44, Groups: []int{44}, Username: "alice", Home: "/home/alice", ProvisionHome: true}, ""},
		{"nonexistent home becomes /", &api.JobUser{Username: s("svc")}, JobUser{UID: 998, GID: 998, Groups: []int{998}, Username: "svc", Home: "/", ProvisionHome: false}, ""},
		{"missing home kept", &api.JobUser{Username: s("ghost")}, JobUser{UID: 997, GID: 997, Groups: []int{997}, Username: "ghost", Home: "/home/ghost", ProvisionHome: true}, ""},
		{"relative home becomes /", &api.JobUser{Username: s("rel")}, JobUser{UID: 996, GID: 996, Groups: []int{996}, Username: "rel", Home: "/", ProvisionHome: false}, ""},
		{"unknown name", &api.JobUser{Username: s("bob")}, JobUser{}, `user "bob" not found`},
		{"unknown group", &api.JobUser{Username: s("alice"), Groupname: s("nope")}, JobUser{}, `group "nope" not found`},
		{"neither uid nor name", &api.JobUser{}, JobUser{}, "neither uid nor username is set"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := a.Resolve(tc.in, 0)
			if tc.wantErr != "" {
				if err == nil || err.Error() != tc.wantErr {
					t.Fatalf("err %v want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.UID != tc.want.UID || got.GID != tc.want.GID || !slices.Equal(got.Groups, tc.want.Groups) ||
				got.Username != tc.want.Username || got.Home != tc.want.Home || got.ProvisionHome != tc.want.ProvisionHome {
				t.Fatalf("got %+v want %+v", got, tc.want)
			}
		})
	}
}

func TestHomeOf(t *testing.T) {
	a := Accounts{Root: fixtureRoot(t)}
	if a.HomeOf(1000) != "/home/alice" || a.HomeOf(0) != "/root" || a.HomeOf(4242) != "" {
		t.Fatalf("%q %q %q", a.HomeOf(1000), a.HomeOf(0), a.HomeOf(4242))
	}
}

// An SSH login as root works in an image whose /etc/passwd does not name
// root or that has none (FROM scratch, distroless): uid 0, group 0, home
// /root when there is one (else /), no shell named. Other unknown names
// are still refused.
func TestLoginAsRootWithoutPasswd(t *testing.T) {
	for _, c := range []struct {
		name   string
		passwd string // "": no /etc/passwd
		root   bool   // a /root dir
		home   string
	}{
		{"no passwd, /root", "", true, "/root"},
		{"no passwd, no /root", "", false, "/"},
		{"passwd without root", "alice:x:1000:1000::/home/alice:/bin/sh\n", true, "/root"},
	} {
		dir := t.TempDir()
		_ = os.MkdirAll(filepath.Join(dir, "etc"), 0o755)
		if c.root {
			_ = os.MkdirAll(filepath.Join(dir, "root"), 0o700)
		}
		if c.passwd != "" {
			_ = os.WriteFile(filepath.Join(dir, "etc", "passwd"), []byte(c.passwd), 0o644)
		}
		a := Accounts{Root: dir}
		l, err := a.Login("root")
		if err != nil || l.UID != 0 || l.GID != 0 || l.Home != c.home || l.Shell != "" || l.Username != "root" {
			t.Errorf("%s: %+v %v", c.name, l, err)
		}
		if _, err := a.Login("mallory"); err == nil {
			t.Errorf("%s: an unknown name logged in", c.name)
		}
	}
	// Where passwd names root, its entry stands.
	l, err := Accounts{Root: fixtureRoot(t)}.Login("root")
	if err != nil || l.Shell != "/bin/bash" || l.Home != "/root" || l.Username != "root" {
		t.Fatalf("root from passwd: %+v %v", l, err)
	}
}
