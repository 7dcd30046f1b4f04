// Package principal decides which local accounts may drive the agents. The
// shim's API starts privileged containers with any host path mounted, so it
// is root on the host: it admits only callers who are root already, by the
// host's own policy. A uid is root-equivalent when it is
//
//   - 0 (root);
//   - allowed by the host's sudo to run a shell as root (with or without a
//     password: a user who knows their password is root). sudo itself is
//     asked (sudo -n -l -U NAME -u root /bin/sh), so the answer is its own,
//     every rule of its policy included; a host without sudo grants none;
//   - a member of the group that may write the Docker socket (docker run
//     --privileged is root);
//   - listed by the operator (Policy.Allow: a uid, a user name or @group).
//
// Accounts and groups are read from the host's files (passwd, group under
// Root), so accounts known only through NSS (LDAP, SSSD) must be allowed
// by uid or by a group listed in /etc/group, unless sudo grants them (sudo
// is asked by the name passwd gives, or NSS where passwd has none).
package principal

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// DefaultDockerSocket is the socket whose group is root-equivalent.
const DefaultDockerSocket = "/var/run/docker.sock"

// Policy answers "is this uid root-equivalent here?". Its answers are kept
// for TTL, so an account added to sudo is admitted within that time and
// one removed is refused within it.
type Policy struct {
	// Root is prepended to every host path read ("" or "/": the host).
	Root string
	// DockerSocket is the Docker socket whose group is root-equivalent
	// (DefaultDockerSocket when empty; "-" for none).
	DockerSocket string
	// Allow lists more principals: "1000" (a uid), "alice" (a user),
	// "@gpuops" (every member of a group).
	Allow []string
	// TTL is how long a decision is kept (5 s when zero).
	TTL time.Duration
	// Sudo is the sudo binary asked ("" : the host's own, found in the
	// usual places, when Root is the host; none for a fixture Root; "-":
	// none).
	Sudo string
	// SudoTimeout bounds one question to sudo (DefaultSudoTimeout when
	// zero); no answer in time is a refusal.
	SudoTimeout time.Duration
	Now         func() time.Time
	Log         *slog.Logger

	mu       sync.Mutex // guards the fields below
	cache    map[uint32]cached
	inflight map[uint32]chan struct{} // a uid being decided: closed when done
	warned   bool                     // the lack of sudo was logged
}

type cached struct {
	d  Decision
	at time.Time
}

// Decision is the answer for one uid.
type Decision struct {
	Allowed bool
	// Who names the account ("uid 1000 (alice)").
	Who string
	// Why says which rule admitted it, or that none did.
	Why string
}

// snapshot is what the host's files said when they were read: the
// accounts, the groups and the Docker socket's group.
// One read serves every account AllowedUIDs decides at a task's start.
type snapshot struct {
	names     map[uint32]string // passwd: uid -> name
	primary   map[uint32]uint32 // passwd: uid -> primary gid
	groups    []group
	dockerGID uint32
	hasDocker bool
}

type group struct {
	name    string
	gid     uint32
	members []string
}

func (p *Policy) now() time.Time {
	if p.Now != nil {
		return p.Now()
	}
	return time.Now()
}

func (p *Policy) path(s string) string {
	if p.Root == "" || p.Root == "/" {
		return s
	}
	return filepath.Join(p.Root, filepath.Clean("/"+s)) // never above Root
}

// load reads the host's files once.
func (p *Policy) load() *snapshot {
	s := &snapshot{names: map[uint32]string{}, primary: map[uint32]uint32{}}
	forEachLine(p.path("/etc/passwd"), func(f []string) bool {
		if len(f) < 4 {
			return true
		}
		u, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			return true
		}
		if _, dup := s.names[uint32(u)]; !dup { // the first entry counts, as getpwuid's
			s.names[uint32(u)] = f[0]
			if g, err := strconv.ParseUint(f[3], 10, 32); err == nil {
				s.primary[uint32(u)] = uint32(g)
			}
		}
		return true
	})
	forEachLine(p.path("/etc/group"), func(f []string) bool {
		if len(f) < 4 {
			return true
		}
		gid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			return true
		}
		g := group{name: f[0], gid: uint32(gid)}
		for _, m := range strings.Split(f[3], ",") {
			if m = strings.TrimSpace(m); m != "" {
				g.members = append(g.members, m)
			}
		}
		s.groups = append(s.groups, g)
		return true
	})
	s.dockerGID, s.hasDocker = p.dockerGroup()
	return s
}

// account is what a snapshot says about a uid.
type account struct {
	uid    uint32
	name   string // "" when passwd has no entry
	groups map[string]bool
	gids   map[uint32]bool
}

func (s *snapshot) account(uid uint32) account {
	acc := account{uid: uid, name: s.names[uid], groups: map[string]bool{}, gids: map[uint32]bool{}}
	primary, hasPrimary := s.primary[uid]
	for _, g := range s.groups {
		if hasPrimary && g.gid == primary || acc.name != "" && slices.Contains(g.members, acc.name) {
			acc.groups[g.name] = true
			acc.gids[g.gid] = true
		}
	}
	return acc
}

// Decide answers for uid: from the host's files and sudo as they are at
// its first question, then from the cache for TTL. Questions about one uid
// that arrive together (a client's burst of connections) share one answer.
func (p *Policy) Decide(uid uint32) Decision { return p.decideCached(uid, p.load) }

// decideCached is Decide with the host's files read by snap, and only
// when the cache has no answer for uid.
func (p *Policy) decideCached(uid uint32, snap func() *snapshot) Decision {
	ttl := p.TTL
	if ttl <= 0 {
		ttl = 5 * time.Second
	}
	for {
		now := p.now()
		p.mu.Lock()
		if c, ok := p.cache[uid]; ok && now.Sub(c.at) < ttl {
			p.mu.Unlock()
			return c.d
		}
		if wait, busy := p.inflight[uid]; busy {
			p.mu.Unlock()
			<-wait
			continue
		}
		if p.inflight == nil {
			p.inflight = map[uint32]chan struct{}{}
		}
		done := make(chan struct{})
		p.inflight[uid] = done
		p.mu.Unlock()

		d := p.decide(snap(), uid)
		p.mu.Lock()
		if p.cache == nil || len(p.cache) > 4096 {
			p.cache = map[uint32]cached{}
		}
		p.cache[uid] = cached{d: d, at: now}
		delete(p.inflight, uid)
		close(done)
		p.mu.Unlock()
		return d
	}
}

func (p *Policy) decide(s *snapshot, uid uint32) Decision {
	acc := s.account(uid)
	who := "uid " + strconv.FormatUint(uint64(uid), 10)
	if acc.name != "" {
		who += " (" + acc.name + ")"
	}
	d := Decision{Who: who}
	if uid == 0 {
		d.Allowed, d.Why = true, "root"
		return d
	}
	for _, a := range p.Allow {
		a = strings.TrimSpace(a)
		switch {
		case a == "":
		case strings.HasPrefix(a, "@"):
			if acc.groups[a[1:]] {
				d.Allowed, d.Why = true, "allowed by the operator (group "+a[1:]+")"
				return d
			}
		case a == strconv.FormatUint(uint64(uid), 10) || acc.name != "" && a == acc.name:
			d.Allowed, d.Why = true, "allowed by the operator"
			return d
		}
	}
	if s.hasDocker && acc.gids[s.dockerGID] {
		d.Allowed, d.Why = true, "member of the Docker socket's group"
		return d
	}
	name := acc.name
	if name == "" {
		name = p.nssName(uid)
	}
	if name != "" {
		ok, err := p.sudoGrantsShell(context.Background(), name)
		switch {
		case ok:
			d.Allowed, d.Why = true, "sudo lets it run a shell as root"
			return d
		case errors.Is(err, errNoSudo):
			p.noSudoOnce()
		case err != nil:
			if p.Log != nil {
				p.Log.Warn("sudo's answer not taken: the account is refused", "uid", uid, "err", err)
			}
			d.Why = "not root-equivalent on this host: sudo did not answer (" + err.Error() + "), and no other rule admits it"
			return d
		}
	}
	d.Why = "not root-equivalent on this host (not root, sudo does not let it run a shell as root, not in the Docker socket's group, not allowed with --api-allow-user)"
	return d
}

// nssName is the account name of a uid that passwd does not list (one
// known through LDAP or SSSD), when the policy reads the host itself.
func (p *Policy) nssName(uid uint32) string {
	if p.Root != "" && p.Root != "/" {
		return ""
	}
	u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10))
	if err != nil {
		return ""
	}
	return u.Username
}

func (p *Policy) noSudoOnce() {
	p.mu.Lock()
	first := !p.warned
	p.warned = true
	p.mu.Unlock()
	if first && p.Log != nil {
		p.Log.Info("no sudo on this host: no account is root-equivalent through sudo")
	}
}

// forEachLine calls fn with the colon-separated fields of each line of a
// passwd-style file until fn returns false. A missing file has no lines.
func forEachLine(path string, fn func([]string) bool) {
	b, err := readBounded(path)
	if err != nil {
		return
	}
	for _, line := range strings.Split(string(b), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if !fn(strings.Split(line, ":")) {
			return
		}
	}
}

// readBounded reads a host policy file, at most 4 MiB of it, and only a
// regular file, without blocking (an include naming a FIFO or /proc/kmsg
// must not hang the API): these are root's files, but a bound costs
// nothing.
func readBounded(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file", path)
	}
	buf := make([]byte, 0, 4096)
	for len(buf) < 4<<20 {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := f.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err != nil {
			break
		}
	}
	return buf, nil
}

// dockerGroup is the group of the Docker socket when that group may write
// it.
func (p *Policy) dockerGroup() (uint32, bool) {
	sock := p.DockerSocket
	if sock == "-" {
		return 0, false
	}
	if sock == "" {
		sock = DefaultDockerSocket
	}
	gid, mode, err := statGroup(p.path(sock))
	if err != nil || mode&0o020 == 0 || gid == 0 {
		return 0, false
	}
	return gid, true
}

// String describes the rule for logs.
func (p *Policy) String() string {
	s := "root, accounts sudo lets run a shell as root, the Docker socket's group"
	if len(p.Allow) > 0 {
		s += ", and " + strings.Join(p.Allow, ", ")
	}
	return s
}

// Error is a refusal as callers word it.
func (d Decision) Error() string {
	return fmt.Sprintf("%s is %s", d.Who, d.Why)
}

// AllowedUIDs lists the uids Decide admits among the accounts of the
// host's passwd, plus root and the operator's numeric entries: what a
// host-network runner, which cannot read the host's policy, is told to
// serve. Accounts added later are not in it (the task keeps the list it
// started with).
func (p *Policy) AllowedUIDs() []uint32 {
	s := p.load()
	seen := map[uint32]bool{0: true}
	out := []uint32{0}
	for _, a := range p.Allow {
		if v, err := strconv.ParseUint(strings.TrimSpace(a), 10, 32); err == nil && !seen[uint32(v)] {
			seen[uint32(v)] = true
			out = append(out, uint32(v))
		}
	}
	uids := make([]uint32, 0, len(s.names))
	for uid := range s.names {
		if !seen[uid] {
			uids = append(uids, uid)
		}
	}
	slices.Sort(uids)
	// Each account not admitted otherwise is a question to sudo (a few
	// milliseconds each): four at a time, through the cache, so a burst of
	// task starts asks once per TTL; the host's files are the one read
	// above, not one read per account.
	allowed := make([]bool, len(uids))
	sem := make(chan struct{}, 4)
	var wg sync.WaitGroup
	for i, uid := range uids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			allowed[i] = p.decideCached(uid, func() *snapshot { return s }).Allowed
		}()
	}
	wg.Wait()
	for i, uid := range uids {
		if allowed[i] {
			out = append(out, uid)
		}
	}
	return out
}
