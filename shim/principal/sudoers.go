package principal

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// sudoRules are the user specifications of the host's sudoers that grant
// the command ALL as root: the one shape that makes an account root. Other
// rules (a list of commands) are not counted: they are the operator's
// narrower grants, and a shim API caller needs all of root.
type sudoRules struct {
	// who lists each granting rule's users: "alice", "%sudo", "%#27",
	// "#1000", "ALL"; aliases already expanded.
	who [][]string
	// text keeps each rule's line for the decision's reason.
	text []string
}

// sudoRules reads /etc/sudoers and what it includes (@includedir,
// #includedir, @include, #include), at most 64 files deep and wide.
func (p *Policy) sudoRules() (sudoRules, error) {
	var r sudoRules
	aliases := map[string][]string{}
	seen := map[string]bool{}
	var firstErr error
	var read func(path string, depth int)
	read = func(path string, depth int) {
		if depth > 8 || len(seen) >= 64 || seen[path] {
			return
		}
		seen[path] = true
		b, err := readBounded(p.path(path))
		if err != nil {
			if firstErr == nil && !os.IsNotExist(err) {
				firstErr = err
			}
			return
		}
		for _, line := range logicalLines(string(b)) {
			if dir, ok := includeDir(line); ok {
				for _, f := range includedFiles(p.path(dir)) {
					read(filepath.Join(dir, f), depth+1)
				}
				continue
			}
			if inc, ok := includeFile(line); ok {
				if !filepath.IsAbs(inc) {
					inc = filepath.Join(filepath.Dir(path), inc)
				}
				read(inc, depth+1)
				continue
			}
			if i := strings.IndexByte(line, '#'); i >= 0 {
				line = line[:i]
			}
			line = strings.TrimSpace(line)
			if line == "" {
				continue
			}
			first, rest, _ := strings.Cut(line, " ")
			first = strings.TrimSpace(first)
			switch {
			case strings.HasPrefix(first, "Defaults"), first == "Host_Alias", first == "Runas_Alias", first == "Cmnd_Alias", first == "Cmd_Alias":
				continue
			case first == "User_Alias":
				for _, def := range strings.Split(rest, ":") {
					name, members, ok := strings.Cut(def, "=")
					if ok {
						aliases[strings.TrimSpace(name)] = splitList(members)
					}
				}
				continue
			}
			users, spec, ok := splitUserSpec(line)
			if !ok || !grantsAll(spec) {
				continue
			}
			var who []string
			for _, u := range users {
				if exp, ok := aliases[u]; ok {
					who = append(who, exp...)
				} else {
					who = append(who, u)
				}
			}
			r.who = append(r.who, who)
			r.text = append(r.text, line)
		}
	}
	read("/etc/sudoers", 0)
	return r, firstErr
}

// grants reports whether a rule names acc, and which.
func (r sudoRules) grants(acc account) (string, bool) {
	uid := "#" + strconv.FormatUint(uint64(acc.uid), 10)
	for i, who := range r.who {
		if slices.ContainsFunc(who, func(s string) bool { return strings.HasPrefix(s, "!") }) {
			continue // a negated list: too subtle to read as a grant
		}
		for _, w := range who {
			switch {
			case w == "ALL", w == acc.name, w == uid:
				return r.text[i], true
			case strings.HasPrefix(w, "%#"):
				if g, err := strconv.ParseUint(w[2:], 10, 32); err == nil && acc.gids[uint32(g)] {
					return r.text[i], true
				}
			case strings.HasPrefix(w, "%"):
				if acc.groups[w[1:]] {
					return r.text[i], true
				}
			}
		}
	}
	return "", false
}

// logicalLines joins backslash continuations.
func logicalLines(s string) []string {
	var out []string
	var cur strings.Builder
	for _, l := range strings.Split(s, "\n") {
		l = strings.TrimRight(l, " \t\r")
		if strings.HasSuffix(l, "\\") {
			cur.WriteString(strings.TrimSuffix(l, "\\"))
			cur.WriteByte(' ')
			continue
		}
		cur.WriteString(l)
		out = append(out, strings.TrimSpace(cur.String()))
		cur.Reset()
	}
	return out
}

func includeDir(line string) (string, bool) {
	for _, p := range []string{"@includedir ", "#includedir "} {
		if d, ok := strings.CutPrefix(line, p); ok {
			return strings.TrimSpace(d), true
		}
	}
	return "", false
}

func includeFile(line string) (string, bool) {
	for _, p := range []string{"@include ", "#include "} {
		if f, ok := strings.CutPrefix(line, p); ok {
			return strings.TrimSpace(f), true
		}
	}
	return "", false
}

// includedFiles lists a directory as sudo reads it: names without a dot
// and not ending in '~', in order.
func includedFiles(dir string) []string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		n := e.Name()
		if e.IsDir() || strings.Contains(n, ".") || strings.HasSuffix(n, "~") {
			continue
		}
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// splitUserSpec splits "alice,%ops HOST = (ALL:ALL) NOPASSWD: ALL" into its
// users and what follows the first '='.
func splitUserSpec(line string) ([]string, string, bool) {
	lhs, spec, ok := strings.Cut(line, "=")
	if !ok {
		return nil, "", false
	}
	f := strings.Fields(lhs)
	if len(f) < 2 {
		return nil, "", false
	}
	// The users are every field but the last (the host list), joined:
	// "alice, bob ALL" splits as ["alice,", "bob", "ALL"].
	return splitList(strings.Join(f[:len(f)-1], " ")), spec, true
}

// grantsAll reports whether a command specification ("(ALL:ALL) NOPASSWD:
// ALL", "ALL", "(root) /bin/ls, ALL") runs any command as root.
func grantsAll(spec string) bool {
	asRoot := true
	for _, cmd := range strings.Split(spec, ",") {
		cmd = strings.TrimSpace(cmd)
		if strings.HasPrefix(cmd, "(") {
			end := strings.IndexByte(cmd, ')')
			if end < 0 {
				return false
			}
			runas := cmd[1:end]
			users, _, _ := strings.Cut(runas, ":")
			asRoot = strings.TrimSpace(users) == ""
			for _, u := range splitList(users) {
				if u == "ALL" || u == "root" || u == "#0" {
					asRoot = true
				}
			}
			cmd = strings.TrimSpace(cmd[end+1:])
		}
		// Tags: NOPASSWD:, SETENV:, ... and options such as ROLE=x.
		for {
			tag, rest, ok := strings.Cut(cmd, ":")
			if !ok || strings.ContainsAny(tag, " /") || tag == "" || strings.ToUpper(tag) != tag {
				break
			}
			cmd = strings.TrimSpace(rest)
		}
		if asRoot && cmd == "ALL" {
			return true
		}
	}
	return false
}
