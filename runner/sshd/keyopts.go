package sshd

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"
)

// keyOptions are the authorized_keys options of the key a connection
// authenticated with, with OpenSSH's meaning (sshd(8), AUTHORIZED_KEYS FILE
// FORMAT). The zero value grants everything, like a key without options.
type keyOptions struct {
	command    string // forced command; hasCommand tells "" from unset
	hasCommand bool
	from       []string // pattern list the client's address must match
	expiry     time.Time

	noPortForwarding, noPty, noAgent bool
	// permitOpen limits -L destinations ("host:port", "*" wildcards); nil:
	// any. permitListen limits -R listens ("[host:]port"); nil: any.
	permitOpen, permitListen []string
	env                      []string // environment="NAME=value", used only when enabled
}

// parseKeyOptions reads the options of one authorized_keys line. An option
// we do not implement is an error: the key is refused rather than granted
// more than its owner wrote.
func parseKeyOptions(opts []string) (keyOptions, error) {
	var o keyOptions
	for _, raw := range opts {
		name, val, hasVal := strings.Cut(raw, "=")
		lname := strings.ToLower(name)
		if hasVal {
			v, err := unquoteOption(val)
			if err != nil {
				return o, fmt.Errorf("option %s: %w", name, err)
			}
			val = v
		}
		switch {
		case lname == "restrict" && !hasVal:
			o.noPortForwarding, o.noPty, o.noAgent = true, true, true
		case lname == "no-port-forwarding" && !hasVal:
			o.noPortForwarding = true
		case lname == "port-forwarding" && !hasVal:
			o.noPortForwarding = false
		case lname == "no-pty" && !hasVal:
			o.noPty = true
		case lname == "pty" && !hasVal:
			o.noPty = false
		case lname == "no-agent-forwarding" && !hasVal:
			o.noAgent = true
		case lname == "agent-forwarding" && !hasVal:
			o.noAgent = false
		// We never run ~/.ssh/rc and never forward X11: these grant or
		// take away nothing here.
		case (lname == "no-x11-forwarding" || lname == "x11-forwarding" || lname == "no-user-rc" || lname == "user-rc") && !hasVal:
		case lname == "command" && hasVal:
			o.command, o.hasCommand = val, true
		case lname == "from" && hasVal:
			o.from = append(o.from, strings.Split(val, ",")...)
		case lname == "permitopen" && hasVal:
			for _, p := range strings.Split(val, ",") {
				if p == "any" {
					continue
				}
				if _, _, err := net.SplitHostPort(p); err != nil && p != "none" {
					return o, fmt.Errorf("permitopen %q: want host:port", p)
				}
			}
			o.permitOpen = append(o.permitOpen, strings.Split(val, ",")...)
		case lname == "permitlisten" && hasVal:
			o.permitListen = append(o.permitListen, strings.Split(val, ",")...)
		case lname == "expiry-time" && hasVal:
			t, err := parseExpiry(val)
			if err != nil {
				return o, err
			}
			o.expiry = t
		case lname == "environment" && hasVal:
			if k, _, ok := strings.Cut(val, "="); !ok || k == "" {
				return o, fmt.Errorf("environment %q: want NAME=value", val)
			}
			o.env = append(o.env, val)
		default:
			return o, fmt.Errorf("option %q is not supported by this server", raw)
		}
	}
	return o, nil
}

// unquoteOption undoes the option value's quoting: "..." with \" inside.
func unquoteOption(v string) (string, error) {
	if len(v) < 2 || v[0] != '"' || v[len(v)-1] != '"' {
		return v, nil
	}
	inner := v[1 : len(v)-1]
	return strings.ReplaceAll(inner, `\"`, `"`), nil
}

// parseExpiry reads YYYYMMDD[HHMM[SS]] in UTC (OpenSSH uses the system's
// zone; containers run in UTC).
func parseExpiry(v string) (time.Time, error) {
	layouts := map[int]string{8: "20060102", 12: "200601021504", 14: "20060102150405"}
	l, ok := layouts[len(v)]
	if !ok {
		return time.Time{}, fmt.Errorf("expiry-time %q: want YYYYMMDD[HHMM[SS]]", v)
	}
	t, err := time.ParseInLocation(l, v, time.UTC)
	if err != nil {
		return time.Time{}, fmt.Errorf("expiry-time %q: %w", v, err)
	}
	return t, nil
}

// admits reports whether the key may log in now from addr, and why not.
func (o keyOptions) admits(now time.Time, addr net.Addr) (bool, string) {
	if !o.expiry.IsZero() && !now.Before(o.expiry) {
		return false, "key expired at " + o.expiry.Format(time.RFC3339)
	}
	if len(o.from) > 0 {
		host := addr.String()
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		if !matchPatternList(o.from, host) {
			return false, "from= does not allow " + host
		}
	}
	return true, ""
}

// matchPatternList is OpenSSH's pattern-list match against an address: a
// negated match (!pattern) refuses outright, else any positive match
// admits. Patterns are globs (* and ?) or CIDR blocks.
func matchPatternList(patterns []string, ip string) bool {
	matched := false
	for _, p := range patterns {
		p = strings.TrimSpace(p)
		neg := strings.HasPrefix(p, "!")
		p = strings.TrimPrefix(p, "!")
		if matchAddr(p, ip) {
			if neg {
				return false
			}
			matched = true
		}
	}
	return matched
}

func matchAddr(pattern, ip string) bool {
	if strings.Contains(pattern, "/") {
		_, n, err := net.ParseCIDR(pattern)
		addr := net.ParseIP(ip)
		return err == nil && addr != nil && n.Contains(addr)
	}
	return globMatch(strings.ToLower(pattern), strings.ToLower(ip))
}

// globMatch is OpenSSH's match_pattern: '*' matches any run of bytes,
// '?' any one byte, and every other byte only itself. (path.Match, used
// before, also read [classes] and \ escapes: from="10.0.0.[1-5]" then
// admitted 10.0.0.1-5, which OpenSSH's sshd never does.) Going back only
// to the last '*' bounds it at len(pattern) x len(s) steps.
func globMatch(pattern, s string) bool {
	p, i := 0, 0
	star, mark := -1, 0 // the last '*' seen, and where in s it matched from
	for i < len(s) {
		switch {
		case p < len(pattern) && (pattern[p] == '?' || pattern[p] == s[i]) && pattern[p] != '*':
			p++
			i++
		case p < len(pattern) && pattern[p] == '*':
			star, mark = p, i
			p++
		case star >= 0: // let the last '*' take one more byte
			mark++
			p, i = star+1, mark
		default:
			return false
		}
	}
	for p < len(pattern) && pattern[p] == '*' {
		p++
	}
	return p == len(pattern)
}

// permitsOpen checks a -L destination against permitopen.
func (o keyOptions) permitsOpen(host string, port uint32) bool {
	if o.noPortForwarding {
		return false
	}
	if o.permitOpen == nil {
		return true
	}
	for _, p := range o.permitOpen {
		if p == "any" {
			return true
		}
		ph, pp, err := net.SplitHostPort(p)
		if err != nil {
			continue
		}
		if (ph == "*" || strings.EqualFold(ph, host)) && (pp == "*" || pp == strconv.Itoa(int(port))) {
			return true
		}
	}
	return false
}

// permitsListen checks a -R listen against permitlisten.
func (o keyOptions) permitsListen(host string, port uint32) bool {
	if o.noPortForwarding {
		return false
	}
	if o.permitListen == nil {
		return true
	}
	for _, p := range o.permitListen {
		if p == "any" {
			return true
		}
		ph, pp := "localhost", p
		if h, port, err := net.SplitHostPort(p); err == nil {
			ph, pp = h, port
		}
		hostOK := ph == "*" || strings.EqualFold(ph, host) || (ph == "localhost" && (host == "" || host == "localhost" || host == "127.0.0.1" || host == "::1"))
		if hostOK && (pp == "*" || pp == strconv.Itoa(int(port))) {
			return true
		}
	}
	return false
}
