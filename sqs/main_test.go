package sqs_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
