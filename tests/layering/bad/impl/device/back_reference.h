// A fixture for the test "layering_catches_a_back_reference": device/ sits
// below comm/, so this include must be refused. Not compiled.
#pragma once

#include "impl/comm/group.h"
