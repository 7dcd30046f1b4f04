// Package account reads the image's users and groups (passwd and group
// files under a root, no libc, no NSS: static runners in any image) and
// resolves a job user or an SSH login from them. The executor and the SSH
// server both use it; each resolves a user once.
package account

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// JobUser is the resolved identity a job runs as.
type JobUser struct {
	UID, GID int
	Groups   []int
	Username string
	Home     string
	// ProvisionHome is false when the home is unusable ("/"): git
	// credentials and cluster SSH files are then not written.
	ProvisionHome bool
}

type passwdEntry struct {
	name     string
	uid, gid int
	home     string
	shell    string
}

type groupEntry struct {
	name    string
	gid     int
	members []string
}

// Accounts reads /etc/passwd and /etc/group under Root ("/" in production).
type Accounts struct{ Root string }

func (a Accounts) path(p string) string { return filepath.Join(a.Root, p) }

func (a Accounts) passwd() ([]passwdEntry, error) {
	var out []passwdEntry
	err := readColon(a.path("/etc/passwd"), func(f []string) {
		if len(f) < 7 {
			return
		}
		uid, err1 := strconv.Atoi(f[2])
		gid, err2 := strconv.Atoi(f[3])
		if err1 != nil || err2 != nil {
			return
		}
		out = append(out, passwdEntry{name: f[0], uid: uid, gid: gid, home: f[5], shell: f[6]})
	})
	return out, err
}

func (a Accounts) groups() ([]groupEntry, error) {
	var out []groupEntry
	err := readColon(a.path("/etc/group"), func(f []string) {
		if len(f) < 3 {
			return
		}
		gid, err := strconv.Atoi(f[2])
		if err != nil {
			return
		}
		g := groupEntry{name: f[0], gid: gid}
		if len(f) > 3 && f[3] != "" {
			g.members = strings.Split(f[3], ",")
		}
		out = append(out, g)
	})
	return out, err
}

func readColon(path string, each func([]string)) error {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil // distroless and scratch images may have none
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		each(strings.Split(line, ":"))
	}
	return sc.Err()
}

// Resolve applies dstack's job user rules (runner-protocol.md 6.1). selfUID
// is the runner's own uid, used when the spec has no user.
func (a Accounts) Resolve(u *api.JobUser, selfUID int) (JobUser, error) {
	pw, err := a.passwd()
	if err != nil {
		return JobUser{}, err
	}
	grs, err := a.groups()
	if err != nil {
		return JobUser{}, err
	}
	var entry *passwdEntry
	byUID := func(uid int) *passwdEntry {
		for i := range pw {
			if pw[i].uid == uid {
				return &pw[i]
			}
		}
		return nil
	}
	var ju JobUser
	switch {
	case u == nil:
		ju.UID = selfUID
		entry = byUID(selfUID)
	case u.UID != nil:
		ju.UID = *u.UID
		entry = byUID(*u.UID) // not found is tolerated
	case u.Username != nil && *u.Username != "":
		for i := range pw {
			if pw[i].name == *u.Username {
				entry = &pw[i]
			}
		}
		if entry == nil {
			return JobUser{}, fmt.Errorf("user %q not found", *u.Username)
		}
		ju.UID = entry.uid
	default:
		return JobUser{}, errors.New("neither uid nor username is set")
	}
	if entry != nil {
		ju.Username, ju.Home = entry.name, entry.home
	}
	switch {
	case u != nil && u.GID != nil:
		ju.GID, ju.Groups = *u.GID, []int{*u.GID}
	case u != nil && u.Groupname != nil && *u.Groupname != "":
		found := false
		for _, g := range grs {
			if g.name == *u.Groupname {
				ju.GID, ju.Groups, found = g.gid, []int{g.gid}, true
				break
			}
		}
		if !found {
			return JobUser{}, fmt.Errorf("group %q not found", *u.Groupname)
		}
	case entry != nil:
		ju.GID = entry.gid
		ju.Groups = []int{entry.gid}
		for _, g := range grs {
			if slices.Contains(g.members, entry.name) {
				ju.Groups = append(ju.Groups, g.gid)
			}
		}
	default:
		ju.GID, ju.Groups = 0, []int{0}
	}
	slices.Sort(ju.Groups)
	ju.Groups = slices.Compact(ju.Groups)
	if u == nil && ju.Home == "" {
		ju.Home = "/root"
	}
	ju.ProvisionHome = true
	fi, statErr := os.Stat(a.path(ju.Home))
	switch {
	case ju.Home == "" || !filepath.IsAbs(ju.Home),
		statErr == nil && !fi.IsDir(),
		statErr != nil && strings.Contains(ju.Home, "nonexistent"):
		ju.Home, ju.ProvisionHome = "/", false
	}
	return ju, nil
}

// Login is an account an SSH session runs as.
type Login struct {
	JobUser
	Shell string
}

// Login looks a user up by name for an SSH login: uid, primary and
// supplementary groups, home and shell.
func (a Accounts) Login(name string) (Login, error) {
	u := name
	ju, err := a.Resolve(&api.JobUser{Username: &u}, 0)
	if err != nil && name == "root" {
		// An image whose /etc/passwd does not name root, or that has
		// none (FROM scratch, distroless): root is uid 0 all the same,
		// as the job itself runs there.
		zero := 0
		ju, err = a.Resolve(&api.JobUser{UID: &zero}, 0)
		ju.Username = name
		if err == nil && ju.Home == "/" {
			if fi, serr := os.Stat(a.path("/root")); serr == nil && fi.IsDir() {
				ju.Home = "/root"
			}
		}
	}
	if err != nil {
		return Login{}, err
	}
	pw, err := a.passwd()
	if err != nil {
		return Login{}, err
	}
	l := Login{JobUser: ju}
	for _, e := range pw {
		if e.name == name {
			l.Shell = e.shell
		}
	}
	return l, nil
}

// HomeOf returns the passwd home of uid ("" when passwd has none).
func (a Accounts) HomeOf(uid int) string {
	pw, _ := a.passwd()
	for _, e := range pw {
		if e.uid == uid && e.home != "" {
			return e.home
		}
	}
	return ""
}

// EnvList renders the map sorted, as NAME=value.
func EnvList(env map[string]string) []string {
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}
