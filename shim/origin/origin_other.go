//go:build !linux

package origin

import (
	"errors"
	"net"
)

var errUnsupported = errors.New("origin checks need Linux procfs")

func (c Checker) socketInode(_, _ *net.TCPAddr) (uint64, error) { return 0, errUnsupported }
func (c Checker) socketOwner(uint64) (int, string, error)       { return 0, "", errUnsupported }
func (c Checker) sameMountNamespace(int) (bool, error)          { return false, errUnsupported }
