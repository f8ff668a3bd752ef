package pgoutbox

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/internal/testenv"
)

// Every broker, consumer and connection the tests open is closed by the
// time they end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
