// Package ident holds the one rule per kind of name or id that arrives over
// the wire and later becomes part of a path, a record, a container name or a
// line in a file. Each is checked at the door: nothing that fails here is
// ever joined to a path or written anywhere.
//
// The rules accept everything dstack sends (UUIDs for task and archive ids,
// short DNS-like names for volumes) and refuse the rest: separators, NUL,
// newlines, dot-only names, leading punctuation and over-long values.
package ident

import (
	"fmt"
)

// Limits on lengths (bytes).
const (
	MaxID         = 128 // task ids, archive ids
	MaxVolumeName = 64
	MaxTaskName   = 200 // container names get "-" and 8 hex digits appended
)

// TaskID checks a shim task id: 1..128 of [A-Za-z0-9._-], starting with a
// letter or digit. A UUID passes.
func TaskID(s string) error { return check("task id", s, MaxID, idChar) }

// ArchiveID checks a runner file-archive id (the server sends a UUID); it
// becomes a file name.
func ArchiveID(s string) error { return check("archive id", s, MaxID, idChar) }

// TaskName checks a task name, which becomes a Docker container name:
// Docker's own rule, [a-zA-Z0-9][a-zA-Z0-9_.-]*.
func TaskName(s string) error { return check("task name", s, MaxTaskName, idChar) }

// VolumeName checks a volume name (volumes and volume_mounts): dstack's
// names are lower-case DNS-like labels; we accept [a-z0-9][a-z0-9._-]*, up
// to 64 bytes. It becomes a directory under the volumes root.
func VolumeName(s string) error { return check("volume name", s, MaxVolumeName, volChar) }

func idChar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.'
}

func volChar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.'
}

func alnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

func check(kind, s string, maxLen int, ok func(byte) bool) error {
	switch {
	case s == "":
		return fmt.Errorf("%s is empty", kind)
	case len(s) > maxLen:
		return fmt.Errorf("%s is %d bytes long; at most %d are allowed", kind, len(s), maxLen)
	case !alnum(s[0]):
		return fmt.Errorf("%s %q must start with a letter or digit", kind, s)
	}
	for i := 0; i < len(s); i++ {
		if !ok(s[i]) {
			return fmt.Errorf("%s %q contains %q at byte %d; allowed are letters, digits and . _ -", kind, s, s[i], i)
		}
	}
	return nil
}
